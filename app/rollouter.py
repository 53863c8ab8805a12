"""The rollouter: streams prompts from a Ray Data dataset into the rollout deployment, scores the results.

Tokenization and the prompt-length check run in Ray Data (`map_batches`); the rollouter (an async Ray
actor) pulls tokenized prompts from the stream epoch after epoch, sends each prompt as one request for its
GRPO group to the Serve deployment, decodes and scores every sample, and returns typed `Group`s.

Two ways to feed the trainer:
- `generate_batch(k)` (sync, one_step_off): the next k groups, generated on request.
- `start_stream()` + `get_batch(k, version)` (fully_async): a background producer keeps up to
  `rollout.max_inflight` groups generating, admitted by `app.admission` (started groups stay within
  (max_staleness + replica version + 1) x batch), and finished groups wait in a bounded FIFO queue here.
  `on_push(version)` raises the admission limit after every push.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import random
import threading
import time
from collections import Counter
from typing import Any

from app import admission
from app.config import parse_lengths
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
        self.lengths = parse_lengths(self.cfg.rollout.lengths)
        self.epoch = 0
        self.cursor = 0  # prompts handed out so far
        self._it = None
        self._lock = threading.Lock()
        self.dropped_overlong = 0
        self.stats: Counter[str] = Counter()
        self.gen_busy_s = 0.0
        self.exhausted = False  # data.epochs reached: no more prompts
        self._retry: collections.deque[dict[str, Any]] = collections.deque()
        # fully_async stream state
        self.version = 0  # the replicas' weight version (after the trainer's pushes)
        self.taken = 0  # groups handed to the trainer
        self.running = 0  # groups generating
        self.ready: collections.deque[Group] = collections.deque()
        self.changed: asyncio.Condition | None = None
        self.producer: asyncio.Task | None = None
        self.stream_error: BaseException | None = None
        self.idle_since: float | None = None  # no group generating since (rollout idle time)
        self.idle_s = 0.0
        self.window_start = time.perf_counter()
        self.attempts: Counter[str] = Counter()

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
            while self._retry and len(out) < k:  # prompts to generate again (failed or regenerated groups)
                out.append(self._retry.popleft())
            while len(out) < k:
                if self.cfg.data.epochs and self.epoch >= self.cfg.data.epochs:
                    self.exhausted = True
                    break
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
                self.cursor += 1
        return out

    async def _group(self, row: dict[str, Any], n: int, temperature: float, seed: int | None) -> Group:
        r = self.cfg.rollout
        req = {
            "prompt_ids": json.loads(row["prompt_ids"]),
            "n": n,
            "max_tokens": admission.response_budget(self.lengths, row["uid"], self.cfg.seed, r.max_tokens),
            "temperature": temperature,
            "top_p": r.top_p if temperature > 0 else 1.0,
            "seed": seed,
            "ignore_eos": r.ignore_eos,
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
        if r.partial == "resubmit":
            resp["samples"] = [await self._complete(req, smp) for smp in resp["samples"]]
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
            row["uid"],
            req["prompt_ids"],
            row["answer"],
            samples,
            row.get("epoch", 0),
            row["prompt"],
            row["data_source"],
        )

    async def _complete(self, req: dict[str, Any], sample: dict[str, Any]) -> dict[str, Any]:
        """rollout.partial=resubmit: a sample aborted by a push goes back as prompt + partial response
        until it finishes; its earlier tokens keep their versions and behaviour log-probs."""
        rounds = 0
        while sample["finish_reason"] == "abort" and len(sample["token_ids"]) < req["max_tokens"]:
            rounds += 1
            if rounds > 100:
                raise RuntimeError("a sample was aborted by 100 pushes in a row; is generation progressing?")
            self.stats["async/resubmitted"] += 1
            cont = {
                **req,
                "prompt_ids": req["prompt_ids"] + sample["token_ids"],
                "n": 1,
                "max_tokens": req["max_tokens"] - len(sample["token_ids"]),
                "seed": None,
            }
            resp = await asyncio.wait_for(
                self.handle.generate.remote(cont), timeout=self.cfg.rollout.request_timeout_s
            )
            sample = admission.merge_partial(sample, resp["samples"][0])
        return sample

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
        return Batch(
            list(groups),
            generate_s=dt,
            dropped_overlong=self.dropped_overlong,
            reward_errors=self._reward_errors(),
        )

    async def validate(self) -> dict[str, Any]:
        """Greedy (or `algorithm.val_temperature`) answers to the validation prompts; mean reward + a sample table."""
        t0 = time.perf_counter()
        rows = self.val_prompts
        groups = await asyncio.gather(
            *[self._group(row, 1, self.cfg.algorithm.val_temperature, 0) for row in rows]
        )
        rewards = [g.samples[0].reward for g in groups]
        versions = [v for g in groups for v in g.samples[0].versions]
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
            "version_min": min(versions, default=-1),
            "version_max": max(versions, default=-1),
        }

    # ------------------------------------------------------------ fully_async: the stream

    def _limit(self) -> int:
        a = self.cfg.algorithm
        return admission.admission_limit(a.max_staleness, self.version, self.cfg.train.batch_groups)

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    def _set_running(self, delta: int) -> None:
        now = time.perf_counter()
        if self.running == 0 and delta > 0 and self.idle_since is not None:
            self.idle_s += now - self.idle_since
            self.idle_since = None
        self.running += delta
        if self.running == 0:
            self.idle_since = now

    async def start_stream(self) -> None:
        """Start the background producer (idempotent). Call after the trainer's first push."""
        if self.producer is None:
            self.changed = asyncio.Condition()
            self.idle_since = self.window_start = time.perf_counter()
            self.producer = asyncio.get_running_loop().create_task(self._produce())

    async def on_push(self, version: int) -> None:
        """The replicas now serve `version`: admission may start more groups."""
        self.version = max(self.version, version)
        if self.changed is not None:
            await self._notify()

    async def _produce(self) -> None:
        r = self.cfg.rollout
        base = random.Random(self.cfg.seed * 1_000_003 + 7)
        try:
            while True:
                async with self.changed:
                    await self.changed.wait_for(
                        lambda: (
                            self.running < r.max_inflight
                            and admission.can_admit(self.taken, len(self.ready), self.running, self._limit())
                        )
                    )
                rows = await asyncio.to_thread(self._next_rows, 1)
                if not rows:  # data.epochs reached: only prompts sent back (failed, regenerated) remain
                    await self._notify()
                    async with self.changed:
                        await self.changed.wait_for(lambda: bool(self._retry))
                    continue
                self._set_running(+1)
                asyncio.get_running_loop().create_task(self._run_group(rows[0], base.randrange(2**31)))
        except Exception as e:  # the prompt stream itself failed (bad data): the trainer's get_batch raises
            self.stream_error = e
            await self._notify()

    async def _run_group(self, row: dict[str, Any], seed: int) -> None:
        r = self.cfg.rollout
        try:
            g = await self._group(row, r.n, r.temperature, seed)
            self.ready.append(g)
        except Exception as e:  # a failed group: its prompt goes back to the stream (three tries)
            self.attempts[row["uid"]] += 1
            self.stats["async/failed_groups"] += 1
            log.warning("group for prompt %s failed (try %d): %s", row["uid"], self.attempts[row["uid"]], e)
            if self.attempts[row["uid"]] >= 3:
                self.stream_error = RuntimeError(f"prompt {row['uid']} failed 3 times; last error: {e}")
            else:
                with self._lock:
                    self._retry.append(row)
        finally:
            self._set_running(-1)
            await self._notify()

    async def get_batch(self, num_groups: int, version: int, timeout_s: float) -> Batch:
        """The next `num_groups` finished groups (FIFO by completion) for the trainer at `version`.

        Groups over the staleness bound are trained or regenerated per `algorithm.over_bound` and counted.
        Returns fewer groups (possibly none) only when the data is exhausted and everything drained. Raises
        TimeoutError after `timeout_s` naming what the stream was doing.
        """
        a = self.cfg.algorithm
        t0 = time.perf_counter()
        deadline = t0 + timeout_s
        out: list[Group] = []
        over = 0
        while len(out) < num_groups:
            if self.stream_error is not None:
                raise RuntimeError(f"the rollout stream failed: {self.stream_error}")
            if self.ready:
                g = self.ready.popleft()
                if admission.over_bound(version, g.min_version, a.max_staleness):
                    over += 1
                    self.stats["async/over_bound"] += 1
                    if a.over_bound == "regenerate":
                        with self._lock:
                            self._retry.append(self._row_of(g))
                        await self._notify()
                        continue
                out.append(g)
                self.taken += 1
                await self._notify()
                continue
            if self.exhausted and self.running == 0 and not self._retry:
                break  # the data is exhausted and everything drained
            left = deadline - time.perf_counter()
            if left <= 0:
                raise TimeoutError(
                    f"waited {timeout_s:.0f}s for {num_groups} finished groups (have {len(out)}): "
                    f"{self.running} generating, {len(self.ready)} queued, {self.taken} taken, admission "
                    f"limit {self._limit()} at replica version {self.version}, exhausted={self.exhausted}"
                )
            async with self.changed:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), timeout=min(left, 1.0))
        now = time.perf_counter()
        idle = self.idle_s + (now - self.idle_since if self.idle_since is not None else 0.0)
        window = max(1e-9, now - self.window_start)
        self.idle_s, self.window_start = 0.0, now
        if self.idle_since is not None:
            self.idle_since = now
        return Batch(
            out,
            generate_s=now - t0,
            dropped_overlong=self.dropped_overlong,
            reward_errors=self._reward_errors(),
            extra={
                "async/queue_depth": float(len(self.ready)),
                "async/running": float(self.running),
                "async/rollout_idle_ratio": min(1.0, idle / window),
                "async/over_bound": float(self.stats["async/over_bound"]),
                "async/over_bound_batch": float(over),
                "async/failed_groups": float(self.stats["async/failed_groups"]),
                "async/resubmitted": float(self.stats["async/resubmitted"]),
            },
        )

    def _reward_errors(self) -> dict[str, int]:
        return {k: v for k, v in self.stats.items() if k.startswith("reward/errors_")}

    def _row_of(self, g: Group) -> dict[str, Any]:
        return {
            "uid": g.uid,
            "prompt_ids": json.dumps(g.prompt_ids),
            "answer": g.answer,
            "data_source": g.data_source,
            "prompt": g.prompt_text,
            "epoch": g.epoch,
        }

    async def stop_stream(self) -> None:
        if self.producer is not None:
            self.producer.cancel()

    async def progress(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "dropped_overlong": self.dropped_overlong,
            "exhausted": self.exhausted,
            "running": self.running,
            "queued": len(self.ready),
            "taken": self.taken,
            "replica_version": self.version,
            **dict(self.stats),
        }
