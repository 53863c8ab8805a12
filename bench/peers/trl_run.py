"""TRL's side of bench/peers/trl_vs_relay.py: one `trl.GRPOTrainer` run on the job the driver wrote down.

    python bench/peers/trl_run.py SETTINGS.json

SETTINGS.json (written by `trl_vs_relay.py`, which also says what each setting matches in Relay):
    grpo      the `GRPOConfig` keyword arguments
    model     the model folder (a copy of the one Relay trains)
    train     a JSON-lines file of `{"id", "prompt", "answer"}` rows in the order Relay trained them
    val       the validation file; its first `val_size` rows are the validation prompts (0: all of them)
    reward    the name of one of Relay's built-in rewards (`app.rewards.BUILTINS`; default `exact_match`)
    val_every, max_tokens   validate every this many steps (and before the first and after the last)
    metrics   where to append the run's metrics, one JSON line per call, in the layout of Relay's
              `metrics.jsonl` (`{"step", "time", ...}`): a step's `reward/mean` and `tokens` (response tokens
              trained), a validation's `val/reward` and `timing/val_s`
    final     where the final model is saved (Relay saves its final weights too)

A row's prompt is a string (encoded without special tokens, as Relay) or chat messages (TRL and Relay both
apply the tokenizer's chat template with the generation prompt). The validation is the bench's own
`TrainerCallback`: greedy answers (HF `generate`, `do_sample=False`, at most `max_tokens` tokens) to the
validation prompts, scored with the same reward, as Relay's validation (vLLM at temperature 0); a reward's
sub-scores (`strict`, ...) are logged beside it as `val/sub/NAME`, as Relay logs them. The last line on stdout is `RESULT {json}` with `loop_s` (from the end of the first
validation to the end of the last optimizer step, validations within it included, as Relay's `loop_s`) and
`trained_tokens` (the response tokens of every trained completion, EOS included, as Relay counts them).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app.rewards import BUILTINS, RewardFn

log = logging.getLogger("bench.peers.trl")


def scored(fn: RewardFn, response: str, answer: str) -> dict[str, float]:
    """`fn`'s value for one response as `{"score": s, **sub-scores}` (a built-in returns a float or such a
    dict)."""
    value = fn(response, answer)
    return dict(value) if isinstance(value, dict) else {"score": float(value)}


def response_text(completion: Any) -> str:
    """A TRL completion's text: the string itself, or the content of a conversational one's last message."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def prompt_ids(tok: Any, prompt: str | list[dict]) -> list[int]:
    """The prompt's token ids as Relay renders them (app.rollout.prompt_files.render_prompt)."""
    from app.rollout.prompt_files import PromptRow, render_prompt

    return render_prompt(PromptRow(uid="", prompt=prompt, answer="", data_source="", index=0), tok)


class Metrics:
    """Appends `{"step", "time", **values}` lines to a file (Relay's metrics.jsonl layout)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def append(self, step: int, values: dict[str, float]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "time": round(time.time(), 3), **values}) + "\n")


class RewardCounter:
    """One of Relay's built-in rewards as a TRL reward function (`answer` is the dataset's column), counting
    the response tokens and rewards of the completions it scores, until `take()`."""

    def __init__(self, name: str = "exact_match") -> None:
        self.fn, self.__name__ = BUILTINS[name], name  # TRL names a reward function's metrics after it
        self.tokens, self.rewards = 0, []

    def __call__(
        self, prompts: list, completions: list, completion_ids: list, answer: list, **_: Any
    ) -> list:
        texts = [response_text(c) for c in completions]
        scores = [scored(self.fn, t, a)["score"] for t, a in zip(texts, answer, strict=True)]
        self.tokens += sum(len(ids) for ids in completion_ids)
        self.rewards += scores
        return scores

    def take(self) -> tuple[int, float]:
        tokens, rewards = self.tokens, self.rewards
        self.tokens, self.rewards = 0, []
        return tokens, sum(rewards) / max(1, len(rewards))


def greedy_reward(
    model: Any, tok: Any, rows: list[dict], max_tokens: int, fn: RewardFn = BUILTINS["exact_match"]
) -> dict[str, float]:
    """Mean reward `fn` of greedy answers (at most `max_tokens` tokens, cut at EOS) to `rows`: `{"score":
    mean, **mean of each sub-score}`."""
    import torch

    ids = [prompt_ids(tok, r["prompt"]) for r in rows]
    width = max(map(len, ids))
    x = torch.full((len(ids), width), tok.pad_token_id)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, row in enumerate(ids):  # left-padded, as TRL generates
        x[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=x.to(model.device),  # (a GPU run's model is on its GPU)
            attention_mask=mask.to(model.device),
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    model.train(was_training)
    totals: dict[str, float] = {}
    for completion, r in zip(out[:, width:].tolist(), rows, strict=True):
        if tok.eos_token_id in completion:
            completion = completion[: completion.index(tok.eos_token_id) + 1]
        for k, v in scored(fn, tok.decode(completion, skip_special_tokens=True), r["answer"]).items():
            totals[k] = totals.get(k, 0.0) + v
    return {k: v / len(rows) for k, v in totals.items()}


def make_callback(metrics: Metrics, counter: RewardCounter, val_rows: list[dict], settings: dict) -> Any:
    """The bench's TrainerCallback: validation before the first step, every `val_every` steps and after the
    last; each step's trained tokens and mean reward; the loop's start and end times."""
    from transformers import TrainerCallback

    every, max_tokens, steps = settings["val_every"], settings["max_tokens"], settings["grpo"]["max_steps"]

    class Validation(TrainerCallback):
        t_run = t_loop_end = 0.0
        tokens = 0
        first = last = None

        def validate(self, model: Any, tok: Any, step: int) -> None:
            t0 = time.perf_counter()
            means = greedy_reward(model, tok, val_rows, max_tokens, counter.fn)
            reward = means.pop("score")
            subs = {f"val/sub/{k}": v for k, v in means.items()}
            metrics.append(step, {"val/reward": reward, **subs, "timing/val_s": time.perf_counter() - t0})
            self.first = reward if self.first is None else self.first
            self.last = reward
            log.info("validation after step %d: reward %.3f", step, reward)

        def on_train_begin(self, args, state, control, model=None, processing_class=None, **kw):
            self.validate(model, processing_class, 0)
            self.t_run = self.t_loop_end = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, processing_class=None, **kw):
            self.t_loop_end = time.perf_counter()
            tokens, reward = counter.take()
            self.tokens += tokens
            metrics.append(state.global_step, {"reward/mean": reward, "tokens": tokens})
            if state.global_step % every == 0 or state.global_step == steps:
                self.validate(model, processing_class, state.global_step)

    return Validation()


def read_rows(path: str, limit: int = 0) -> list[dict]:
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
            if limit and len(rows) >= limit:
                break
    return rows


def main(settings_path: str) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = json.loads(Path(settings_path).read_text())
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    train = [{k: r[k] for k in ("id", "prompt", "answer")} for r in read_rows(settings["train"])]
    val_rows = read_rows(settings["val"], settings["val_size"])
    counter, metrics = RewardCounter(settings.get("reward", "exact_match")), Metrics(settings["metrics"])
    callback = make_callback(metrics, counter, val_rows, settings)
    trainer = GRPOTrainer(
        model=settings["model"],
        reward_funcs=counter,
        args=GRPOConfig(**settings["grpo"]),
        train_dataset=Dataset.from_list(train),
        callbacks=[callback],
    )
    if isinstance(train[0]["prompt"], str):  # TRL tokenizes a string with special tokens, Relay without
        trl_ids = trainer.processing_class(text=[train[0]["prompt"]])["input_ids"][0]
        relay_ids = prompt_ids(trainer.processing_class, train[0]["prompt"])
        if list(trl_ids) != relay_ids:
            raise RuntimeError(f"TRL's prompt tokens {trl_ids} differ from Relay's {relay_ids}")
    trainer.train()
    trainer.save_model(settings["final"])
    result = {
        "ok": True,
        "steps": trainer.state.global_step,
        "loop_s": callback.t_loop_end - callback.t_run,
        "trained_tokens": callback.tokens,
        "val_reward_first": callback.first,
        "val_reward_last": callback.last,
    }
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
