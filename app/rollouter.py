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
from app.records import Batch, Group, Sample, group_key
from app.reward_pool import RewardPool

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


_ROW_KEYS = ("uid", "prompt_ids", "answer", "data_source", "prompt", "epoch", "index", "is_chat")


def _plain(o: Any) -> Any:
    return o.item() if hasattr(o, "item") else str(o)


class Frozen(Exception):
    """A group whose generation was ended by `snapshot(freeze=True)`: kept as a partial rollout."""


class Rollouter:
    """Async Ray actor. `generate_batch(k)` returns the next k prompt groups, scored.

    Checkpoint state (`snapshot` / `restore`): every row taken from the prompt stream is `outstanding` until
    the trainer acknowledges the group as trained (`ack`); a snapshot holds the stream position (epoch and
    the prompt ids of that epoch already taken), the finished groups not yet trained (with their samples,
    versions and behaviour log-probs) and every other outstanding prompt, with its partial samples where a
    freeze ended its generation. Restoring it trains each prompt group of an epoch exactly once.
    """

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
        # the reward stage (CPU workers or this actor's threads) and the reference workers
        self.rewards = RewardPool(self.cfg.reward, self.cfg.ray.name)
        self.refs = None
        if self.cfg.algorithm.kl_coef > 0 and self.cfg.ref.workers > 0:
            from app.reference import RefPool

            self.refs = RefPool(self.cfg, model_path)
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
        # checkpoint state
        self.outstanding: dict[str, dict[str, Any]] = {}  # rows taken from the stream, not yet trained
        self.epoch_seen: set[str] = set()  # prompt ids of the current epoch taken from the stream
        self.inflight: set[str] = set()  # groups generating now (both feeding paths)
        self.gen = 0  # bumped by `restore`: groups started before it are dropped when they finish
        self.freezing = False  # `snapshot(freeze=True)`: aborted samples are kept as partial rollouts
        self.partials: dict[str, list[dict[str, Any]]] = {}
        self.restores = 0

    def _iter_epoch(self):
        ds = self.train_ds
        if self.cfg.data.shuffle:
            ds = ds.random_shuffle(seed=self.cfg.data.seed + self.epoch)
        return iter(ds.iter_rows())

    def _next_rows(self, k: int, gen: int | None = None) -> list[dict[str, Any]]:
        """Next k usable prompts from the stream, crossing epochs; overlong ones are counted and skipped.
        A request from before a restore (`gen` older than the current) gets none."""
        out: list[dict[str, Any]] = []
        with self._lock:
            if gen is not None and gen != self.gen:
                return out
            empty_epochs = 0
            while self._retry and len(out) < k:  # prompts to generate again (failed, regenerated, restored)
                row = self._retry.popleft()
                self.outstanding[group_key(row["epoch"], row["uid"])] = row
                out.append(row)
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
                    self.epoch_seen = set()
                    empty_epochs = empty_epochs + 1 if not out else 0
                    if empty_epochs > 1:
                        raise DataError(
                            "the training set has no usable prompt (all are over data.max_prompt_tokens?)"
                        ) from None
                    continue
                if row["uid"] in self.epoch_seen:  # taken before the checkpoint this run restored
                    continue
                self.epoch_seen.add(row["uid"])
                if row["overlong"]:
                    self.dropped_overlong += 1
                    continue
                row["epoch"] = self.epoch
                self.outstanding[group_key(self.epoch, row["uid"])] = row
                out.append(row)
                self.cursor += 1
        return out

    async def _group(
        self,
        row: dict[str, Any],
        n: int,
        temperature: float,
        seed: int | None,
        train: bool = True,
        score_now: bool = True,
    ) -> Group:
        """One prompt's group: each sample is its own request, scored the moment it finishes (the reward
        overlaps the rest of the group's generation) unless `score_now` is false (see `_score_group`)."""
        r = self.cfg.rollout
        req = {
            "prompt_ids": json.loads(row["prompt_ids"]),
            "n": 1,
            "max_tokens": admission.response_budget(self.lengths, row["uid"], self.cfg.seed, r.max_tokens),
            "temperature": temperature,
            "top_p": r.top_p if temperature > 0 else 1.0,
            "seed": seed,
            "ignore_eos": r.ignore_eos,
        }
        key = group_key(row.get("epoch", 0), row["uid"]) if train else f"val:{row['uid']}"
        restored = row.get("partial")
        if restored:  # from a checkpoint: continue the saved partial samples
            self.stats["ckpt/resumed_partial_groups"] += 1
        self.inflight.add(key)
        try:
            outs = await asyncio.gather(
                *[
                    self._sample(
                        row,
                        {**req, "seed": None if seed is None else seed + i},
                        dict(restored[i]) if restored else None,
                        score_now,
                    )
                    for i in range(len(restored) if restored else n)
                ]
            )
        finally:
            self.inflight.discard(key)
        if train and self.freezing and any(smp["finish_reason"] == "abort" for smp, _, _ in outs):
            self.partials[key] = [smp for smp, _, _ in outs]  # a checkpoint ended it: saved with versions
            raise Frozen(key)
        samples = []
        for smp, text, res in outs:
            if res is not None and res.error:
                self.stats[f"reward/errors_{res.error}"] += 1
            samples.append(
                Sample(
                    smp["token_ids"],
                    smp["logprobs"],
                    smp["versions"],
                    smp["finish_reason"],
                    text,
                    res.score if res is not None else 0.0,
                    res.error if res is not None else "unscored",
                    res.extras if res is not None else {},
                    smp.get("replica", ""),
                )
            )
        g = Group(
            row["uid"],
            req["prompt_ids"],
            row["answer"],
            samples,
            row.get("epoch", 0),
            row["prompt"],
            row["data_source"],
        )
        if train and score_now and self.refs is not None:
            await self.refs.fill(g)
        return g

    async def _sample(
        self, row: dict[str, Any], req: dict[str, Any], smp: dict[str, Any] | None, score_now: bool
    ) -> tuple[dict[str, Any], str, Any]:
        """Generate (or continue) one sample, then score it at once: (sample, text, RewardResult or None)."""
        if smp is None:
            resp = await self._request(row, req)
            smp = {**resp["samples"][0], "replica": resp["replica"]}
        if self.cfg.rollout.partial == "resubmit" or smp["finish_reason"] == "abort":
            smp = await self._complete(req, smp)
        if self.freezing and smp["finish_reason"] == "abort":
            return smp, "", None
        text = self.tok.decode(smp["token_ids"], skip_special_tokens=True)
        if not score_now:
            return smp, text, None
        return smp, text, await self.rewards.score(row["data_source"], text, row["answer"])

    async def _score_group(self, g: Group) -> Group:
        """Score a group generated with score_now=False (reward.overlap=false: after the whole batch)."""
        results = await asyncio.gather(
            *[self.rewards.score(g.data_source, s.text, g.answer) for s in g.samples]
        )
        for s, res in zip(g.samples, results, strict=True):
            if res.error:
                self.stats[f"reward/errors_{res.error}"] += 1
            s.reward, s.reward_error, s.reward_extras = res.score, res.error, res.extras
        if self.refs is not None:
            await self.refs.fill(g)
        return g

    async def _request(self, row: dict[str, Any], req: dict[str, Any]) -> dict[str, Any]:
        r = self.cfg.rollout
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
        return resp

    async def _complete(self, req: dict[str, Any], sample: dict[str, Any]) -> dict[str, Any]:
        """rollout.partial=resubmit: a sample aborted by a push goes back as prompt + partial response
        until it finishes; its earlier tokens keep their versions and behaviour log-probs."""
        rounds = 0
        while (
            sample["finish_reason"] == "abort"
            and len(sample["token_ids"]) < req["max_tokens"]
            and not self.freezing
        ):
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
        # groups restored from a checkpoint (finished, not yet trained) come first
        gen = self.gen
        restored = [self.ready.popleft() for _ in range(min(num_groups, len(self.ready)))]
        rows = await asyncio.to_thread(self._next_rows, num_groups - len(restored), gen)
        r = self.cfg.rollout
        base = random.Random(self.cfg.seed * 1_000_003 + self.cursor)
        overlap = self.cfg.reward.overlap
        fresh = await asyncio.gather(
            *[self._group(row, r.n, r.temperature, base.randrange(2**31), score_now=overlap) for row in rows]
        )
        if not overlap:  # the baseline: score the batch once all of it is generated
            t_gen = time.perf_counter() - t0
            fresh = await asyncio.gather(*[self._score_group(g) for g in fresh])
            self.stats["timing/reward_after_s"] = time.perf_counter() - t0 - t_gen
        groups = restored + list(fresh)
        if gen != self.gen:
            raise RuntimeError("this batch request was superseded by a restore from a checkpoint")
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
            *[self._group(row, 1, self.cfg.algorithm.val_temperature, 0, train=False) for row in rows]
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
                rows = await asyncio.to_thread(self._next_rows, 1, self.gen)
                if not rows:  # data.epochs reached: only prompts sent back (failed, regenerated) remain
                    await self._notify()
                    async with self.changed:
                        await self.changed.wait_for(lambda: bool(self._retry))
                    continue
                self._set_running(+1)
                asyncio.get_running_loop().create_task(
                    self._run_group(rows[0], base.randrange(2**31), self.gen)
                )
        except Exception as e:  # the prompt stream itself failed (bad data): the trainer's get_batch raises
            self.stream_error = e
            await self._notify()

    async def _run_group(self, row: dict[str, Any], seed: int, gen: int) -> None:
        r = self.cfg.rollout
        try:
            g = await self._group(row, r.n, r.temperature, seed)
            if gen == self.gen:  # else a restore superseded it: its prompt is in the restored state
                self.ready.append(g)
        except Frozen:
            pass  # saved in self.partials by a checkpoint
        except Exception as e:  # a failed group: its prompt goes back to the stream (three tries)
            if gen != self.gen:
                return
            self.attempts[row["uid"]] += 1
            self.stats["async/failed_groups"] += 1
            log.warning("group for prompt %s failed (try %d): %s", row["uid"], self.attempts[row["uid"]], e)
            if self.attempts[row["uid"]] >= 3:
                self.stream_error = RuntimeError(f"prompt {row['uid']} failed 3 times; last error: {e}")
            else:
                with self._lock:
                    self._retry.append(row)
        finally:
            if gen == self.gen:
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
        gen = self.gen
        while len(out) < num_groups:
            if gen != self.gen:  # a trainer that died asked for this batch; its successor restored
                raise RuntimeError("this batch request was superseded by a restore from a checkpoint")
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

    # ------------------------------------------------------------ checkpoint state

    async def ack(self, keys: list[str]) -> None:
        """The trainer trained these groups (`Group.key`): they leave the checkpoint state."""
        for k in keys:
            self.outstanding.pop(k, None)
            self.partials.pop(k, None)

    async def snapshot(self, freeze: bool = False, timeout_s: float = 60.0) -> dict[str, Any]:
        """The pipeline state a checkpoint needs (JSON-able); call at a step boundary, after `ack`.

        freeze=True (a clean stop, the end of a run): stop starting groups and end every generation in flight
        on every replica (vLLM's abort), keeping each group's samples so far, with their per-token versions
        and behaviour log-probs, as a partial rollout that `restore` continues. Without freeze, groups in
        flight are saved as prompts to generate again (what a crash would lose is compute, not prompts).
        """
        if freeze:
            import ray

            from app.serve_rollout import NAMESPACE, hub_name

            self.freezing = True
            if self.producer is not None:
                self.producer.cancel()
                self.producer = None
            hub = ray.get_actor(hub_name(self.cfg.ray.name), namespace=NAMESPACE)
            acks = await hub.abort_inflight.remote(timeout_s)
            deadline = time.monotonic() + timeout_s
            while self.inflight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self.inflight:
                raise TimeoutError(
                    f"checkpoint: {len(self.inflight)} groups still generating {timeout_s:.0f}s after the "
                    f"replicas were asked to abort them ({sorted(self.inflight)[:5]}...); replica answers: {acks}"
                )
        ready_keys = {g.key for g in self.ready}
        pending = []
        for key, row in self.outstanding.items():
            if key in ready_keys:
                continue
            r = {k: v for k, v in row.items() if k in _ROW_KEYS}
            if key in self.partials:
                r["partial"] = self.partials[key]
            pending.append(r)
        snap = {
            "epoch": self.epoch,
            "epoch_seen": sorted(self.epoch_seen),
            "cursor": self.cursor,
            "taken": self.taken,
            "version": self.version,
            "dropped_overlong": self.dropped_overlong,
            "ready": [g.to_dict() for g in self.ready],
            "pending": pending,
            "partial_groups": sum(1 for r in pending if r.get("partial")),
            "partial_tokens": sum(len(x["token_ids"]) for r in pending for x in r.get("partial", [])),
        }
        return json.loads(json.dumps(snap, default=_plain))  # numpy scalars from Ray Data rows

    async def restore(self, snap: dict[str, Any]) -> dict[str, int]:
        """Continue from a snapshot: its finished groups are trained first, its other prompts generated
        first (partial rollouts continued from their saved tokens), then the stream goes on where it was."""
        self.gen += 1  # groups started before this point are dropped when they finish
        if self.producer is not None:
            self.producer.cancel()
            self.producer = None
        with self._lock:
            self.freezing = False
            self.ready = collections.deque(Group.from_dict(d) for d in snap["ready"])
            self._retry = collections.deque(snap["pending"])
            self.outstanding = {group_key(r["epoch"], r["uid"]): r for r in snap["pending"]}
            self.outstanding.update({g.key: self._row_of(g) for g in self.ready})
            self.partials = {}
            self.inflight = set()
            self.epoch, self.epoch_seen, self._it = snap["epoch"], set(snap["epoch_seen"]), None
            self.exhausted = False
            self.cursor, self.taken, self.version = snap["cursor"], snap["taken"], snap["version"]
            self.dropped_overlong = snap["dropped_overlong"]
            self.running = 0
            self.idle_since = time.perf_counter()
            self.restores += 1
        log.info(
            "restored the prompt stream: epoch %d, %d finished groups to train, %d prompts to generate "
            "(%d partial)",
            self.epoch,
            len(self.ready),
            len(self._retry),
            snap.get("partial_groups", 0),
        )
        return {
            "ready": len(self.ready),
            "pending": len(self._retry),
            "partial": snap.get("partial_groups", 0),
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
            "generating": len(self.inflight),
            "outstanding": len(self.outstanding),
            "restores": self.restores,
            **dict(self.stats),
        }
