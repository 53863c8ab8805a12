"""The built-in tool task `builtin:calc` and its model `builtin:tiny-calc`: multiplication with a calculator.

Prompts are two-digit products, `37*48=`; the answer is the product. The tiny model cannot multiply in its
head, but it can call the calculator environment (app/envs/calculator.py): `[37*48]`, read `>1776|`, and
answer `1776`. The supervised warm-up teaches the formats only: a quarter of its examples call the tool and
copy the result, the rest answer "from the head" by a wrong rule (the first factor times ten: `370`), so
that the answer's first token, fixed by the prompt, outweighs the call's `[`. The model starts sampling the
tool about a quarter of the time, and greedy validation answers from the head (reward near 0, no tool
calls): GRPO has to discover from rewards alone that calling pays. Splits are disjoint in their (a, b)
pairs.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

from app.envs.calculator import observation
from app.tasks.splits import write_splits

log = logging.getLogger(__name__)

CALC_BUILD_VERSION = 2
CALC_CHARS = list("0123456789") + list("+-*=[]>?|")
CALC_MAX_POSITIONS = 64
TOOL_SHARE = 0.25  # of warm-up examples that call the tool


def make_calc_problems(seed: int = 0, n_val: int = 256) -> tuple[list[dict], list[dict]]:
    """Train and validation rows (`id`, `prompt`, `answer`, `data_source`), disjoint in their pairs."""
    rng = random.Random(seed + 11)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(pairs)

    def rows(split: str, ps: list[tuple[int, int]]) -> list[dict]:
        return [
            {"id": f"calc-{split}-{i}", "prompt": f"{a}*{b}=", "answer": str(a * b), "data_source": "calc"}
            for i, (a, b) in enumerate(ps)
        ]

    return rows("train", pairs[n_val:]), rows("val", pairs[:n_val])


def ensure_calc_task(cache_dir: str | Path, seed: int = 0) -> Path:
    """The task folder (`train.jsonl`, `val.jsonl`), written once under `cache_dir`."""
    root = Path(cache_dir) / f"builtin-calc-task-v{CALC_BUILD_VERSION}-seed{seed}"
    if (root / "val.jsonl").exists():
        return root
    train, val = make_calc_problems(seed)
    return write_splits(root, {"train": train, "val": val})


def head_answer(prompt: str) -> str:
    """The warm-up's answer without the tool: a wrong rule (the first factor times ten; right only when the
    second factor is 10) whose first token the prompt fixes."""
    return prompt.split("*")[0] + "0"


def warmup_example(
    tok, row: dict, rng: random.Random, copy_only: bool = False
) -> tuple[list[int], list[int]]:
    """One warm-up sequence and its label mask (1 on trained tokens): a tool call and the copied result,
    or the head answer (`head_answer`). `copy_only`: a tool episode trained on the copied result alone (reading the
    tool's answer without teaching when to call it)."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    eos = tok.eos_token_id
    ids, mask = enc(row["prompt"]), [0] * len(enc(row["prompt"]))
    if copy_only or rng.random() < TOOL_SHARE:
        a, b = row["prompt"].rstrip("=").split("*")
        parts = [
            ([*enc(f"[{a}*{b}]"), eos], 0 if copy_only else 1),
            (enc(observation(row["answer"])), 0),
            ([*enc(row["answer"]), eos], 1),
        ]
    else:
        parts = [([*enc(head_answer(row["prompt"])), eos], 1)]
    for p, m in parts:
        ids += p
        mask += [m] * len(p)
    return ids, mask


def _warmup(model, tok, train: list[dict], steps: int, seed: int) -> float:
    import torch

    rng = random.Random(seed + 3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    loss = torch.zeros(())
    for _ in range(steps):
        ex = [warmup_example(tok, r, rng) for r in rng.sample(train, 64)]
        ex += [warmup_example(tok, r, rng, copy_only=True) for r in rng.sample(train, 64)]
        width = max(len(i) for i, _ in ex)
        x = torch.full((len(ex), width), tok.pad_token_id)
        labels = torch.full((len(ex), width), -100)
        for k, (ids, m) in enumerate(ex):
            x[k, : len(ids)] = torch.tensor(ids)
            labels[k, : len(ids)] = torch.where(torch.tensor(m) > 0, torch.tensor(ids), -100)
        loss = model(input_ids=x, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())


def ensure_builtin_calc(cache_dir: str | Path, seed: int = 0, warmup_steps: int = 600) -> Path:
    """Build (once) `builtin:tiny-calc`: the tiny architecture over the calculator alphabet, warmed up on
    the call and answer formats. Returns the folder holding `model/`."""
    root = Path(cache_dir) / f"builtin-calc-v{CALC_BUILD_VERSION}-seed{seed}"
    marker = root / "build.json"
    if marker.exists():
        return root
    import torch
    from transformers import Qwen2ForCausalLM

    from app.tasks.tiny import build_tokenizer, model_config, save_built

    log.info("building the embedded tiny calculator model under %s", root)
    root.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(CALC_CHARS, CALC_MAX_POSITIONS)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(model_config(len(tok), CALC_MAX_POSITIONS))
    train, _ = make_calc_problems(seed)
    final = _warmup(model, tok, train, warmup_steps, seed)
    save_built(root, model, tok, {"version": CALC_BUILD_VERSION, "seed": seed, "final_loss": final})
    log.info("embedded calculator model ready: warm-up loss %.3f", final)
    return root
