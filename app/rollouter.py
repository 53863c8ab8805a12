"""The rollouter: streams prompts from a Ray Data dataset into the rollout deployment, scores the results.

Tokenization and the prompt-length check run in Ray Data (`map_batches`); the rollouter (an async Ray
actor) pulls tokenized prompts from the stream epoch after epoch, sends each prompt as one request for its
GRPO group to the Serve deployment, decodes and scores every sample, and returns typed `Group`s.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
import time
from collections import Counter
from typing import Any

from app.data import DataError, PromptRow, render_prompt
from app.records import Batch, Group, Sample
from app.rewards import resolve_reward_fn, score

log = logging.getLogger(__name__)


def rollouter_name(prefix: str) -> str:
    return f"{prefix}-rollouter"


class Tokenize:
    """Ray Data stage: tokenize prompts (chat template when the tokenizer has one) and flag overlong ones."""

    def __init__(self, tokenizer_path: str, max_prompt_tokens: int, truncation: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(tokenizer_path)
        self.max_tokens = max_prompt_tokens
        self.truncation = truncation

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        ids_col, n_col, over_col = [], [], []
        for i, uid in enumerate(batch["uid"]):
            prompt = batch["prompt"][i]
            prompt = json.loads(prompt) if batch["is_chat"][i] else prompt
            row = PromptRow(
                str(uid),
                prompt,
                str(batch["answer"][i]),
                str(batch["data_source"][i]),
                int(batch["index"][i]),
            )
            ids = render_prompt(row, self.tok)
            over = len(ids) > self.max_tokens
            if over and self.truncation == "error":
                raise DataError(
                    f"prompt {uid} has {len(ids)} tokens, over data.max_prompt_tokens={self.max_tokens}; "
                    "raise data.max_prompt_tokens or set data.truncation=drop"
                )
            ids_col.append(json.dumps(ids))
            n_col.append(len(ids))
            over_col.append(over)
        return {**batch, "prompt_ids": ids_col, "n_prompt_tokens": n_col, "overlong": over_col}


def prompt_dataset(rows: list[PromptRow], tokenizer_path: str, max_prompt_tokens: int, truncation: str):
    import ray

    items = [
        {
            "uid": r.uid,
            "prompt": json.dumps(r.prompt) if isinstance(r.prompt, list) else r.prompt,
            "is_chat": isinstance(r.prompt, list),
            "answer": r.answer,
            "data_source": r.data_source,
            "index": r.index,
        }
        for r in rows
    ]
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ds = ray.data.from_items(items)
    return ds.map_batches(
        Tokenize,
        fn_constructor_args=(tokenizer_path, max_prompt_tokens, truncation),
        batch_size=256,
        compute=ray.data.ActorPoolStrategy(size=1),
        num_cpus=0.25,
    )


class Rollouter:
    """Async Ray actor. `generate_batch(k)` returns the next k prompt groups, scored."""

    def __init__(
        self, cfg: dict[str, Any], model_path: str, train_rows: list[PromptRow], val_rows: list[PromptRow]
    ) -> None:
        from omegaconf import OmegaConf
        from ray import serve
        from transformers import AutoTokenizer

        from app.serve_rollout import DEPLOYMENT_NAME, app_name

        self.cfg = OmegaConf.create(cfg)
        self.tok = AutoTokenizer.from_pretrained(model_path)
        self.handle = serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=app_name(self.cfg.ray.name))
        d = self.cfg.data
        # tokenized once (in Ray Data), then shuffled and streamed epoch after epoch
        self.train_ds = prompt_dataset(
            train_rows, model_path, d.max_prompt_tokens, d.truncation
        ).materialize()
        self.val_rows = val_rows[: d.val_size]
        val_ds = prompt_dataset(self.val_rows, model_path, d.max_prompt_tokens, d.truncation)
        self.val_prompts = [r for r in val_ds.take_all() if not r["overlong"]]
        self.reward_fns: dict[str, Any] = {}
        self.epoch = 0
        self.cursor = 0  # prompts handed out so far
        self._it = None
        self._lock = threading.Lock()
        self.dropped_overlong = 0
        self.stats: Counter[str] = Counter()
        self.gen_busy_s = 0.0

    def _reward_fn(self, data_source: str):
        if data_source not in self.reward_fns:
            self.reward_fns[data_source] = resolve_reward_fn(self.cfg.reward.fn, data_source)
        return self.reward_fns[data_source]

    def _iter_epoch(self):
        ds = self.train_ds
        if self.cfg.data.shuffle:
            ds = ds.random_shuffle(seed=self.cfg.data.seed + self.epoch)
        return iter(ds.iter_rows())

    def _next_rows(self, k: int) -> list[dict[str, Any]]:
        """Next k usable prompts from the stream, crossing epochs; overlong ones are counted and skipped."""
        out: list[dict[str, Any]] = []
        with self._lock:
            empty_epochs = 0
            while len(out) < k:
                if self._it is None:
                    self._it = self._iter_epoch()
                try:
                    row = next(self._it)
                except StopIteration:
                    self._it = None
                    self.epoch += 1
                    empty_epochs = empty_epochs + 1 if not out else 0
                    if empty_epochs > 1:
                        raise DataError(
                            "the training set has no usable prompt (all are over data.max_prompt_tokens?)"
                        ) from None
                    continue
                if row["overlong"]:
                    self.dropped_overlong += 1
                    continue
                row["epoch"] = self.epoch
                out.append(row)
            self.cursor += len(out)
        return out

    async def _group(self, row: dict[str, Any], n: int, temperature: float, seed: int | None) -> Group:
        r = self.cfg.rollout
        req = {
            "prompt_ids": json.loads(row["prompt_ids"]),
            "n": n,
            "max_tokens": r.max_tokens,
            "temperature": temperature,
            "top_p": r.top_p if temperature > 0 else 1.0,
            "seed": seed,
        }
        last: Exception | None = None
        for attempt in range(3):  # a replica that died mid-request: Serve routes the retry elsewhere
            try:
                resp = await asyncio.wait_for(self.handle.generate.remote(req), timeout=r.request_timeout_s)
                break
            except asyncio.TimeoutError:
                last = TimeoutError(
                    f"generation for prompt {row['uid']} took over "
                    f"rollout.request_timeout_s={r.request_timeout_s}s"
                )
            except Exception as e:
                last = e
                self.stats["rollout/request_retries"] += 1
                await asyncio.sleep(0.5 * (attempt + 1))
        else:
            raise RuntimeError(f"rollout failed for prompt {row['uid']} after 3 attempts: {last}") from last
        fn = self._reward_fn(row["data_source"])
        samples = []
        for s in resp["samples"]:
            text = self.tok.decode(s["token_ids"], skip_special_tokens=True)
            res = await asyncio.to_thread(
                score, fn, text, row["answer"], self.cfg.reward.timeout_s, self.cfg.reward.on_error
            )
            if res.error:
                self.stats[f"reward/errors_{res.error}"] += 1
            samples.append(
                Sample(
                    s["token_ids"],
                    s["logprobs"],
                    s["versions"],
                    s["finish_reason"],
                    text,
                    res.score,
                    res.error,
                    res.extras,
                    resp["replica"],
                )
            )
        return Group(
            row["uid"], req["prompt_ids"], row["answer"], samples, row.get("epoch", 0), row["prompt"]
        )

    async def generate_batch(self, num_groups: int) -> Batch:
        t0 = time.perf_counter()
        rows = await asyncio.to_thread(self._next_rows, num_groups)
        r = self.cfg.rollout
        base = random.Random(self.cfg.seed * 1_000_003 + self.cursor)
        groups = await asyncio.gather(
            *[self._group(row, r.n, r.temperature, base.randrange(2**31)) for row in rows]
        )
        dt = time.perf_counter() - t0
        self.gen_busy_s += dt
        errors = {k: v for k, v in self.stats.items() if k.startswith("reward/errors_")}
        return Batch(
            list(groups), generate_s=dt, dropped_overlong=self.dropped_overlong, reward_errors=errors
        )

    async def validate(self) -> dict[str, Any]:
        """Greedy (or `algorithm.val_temperature`) answers to the validation prompts; mean reward + a sample table."""
        t0 = time.perf_counter()
        rows = self.val_prompts
        groups = await asyncio.gather(
            *[self._group(row, 1, self.cfg.algorithm.val_temperature, 0) for row in rows]
        )
        rewards = [g.samples[0].reward for g in groups]
        table = [
            {
                "uid": g.uid,
                "prompt": g.prompt_text,
                "response": g.samples[0].text,
                "answer": g.answer,
                "reward": g.samples[0].reward,
                "version": g.samples[0].versions[-1] if g.samples[0].versions else -1,
            }
            for g in groups[: self.cfg.tracking.log_samples]
        ]
        return {
            "reward": sum(rewards) / max(1, len(rewards)),
            "n": len(rewards),
            "table": table,
            "seconds": time.perf_counter() - t0,
        }

    async def progress(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "dropped_overlong": self.dropped_overlong,
            **dict(self.stats),
        }
