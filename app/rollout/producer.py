"""The fully_async producer: admitted groups generate in the background into a bounded FIFO queue.

A background task takes prompts from the `PromptStream` and starts one group each while fewer than
`max_inflight` generate and `app.rollout.admission` admits it (started groups stay within
(max_staleness + replica version + 1) x batch_groups); finished groups queue in completion order.
`get_batch(k, version)` hands the trainer the next k, training or regenerating a group past the staleness
bound per `over_bound` (and counting it); `on_push(version)` raises the admission limit.

A failed group's prompt goes back to the stream (three tries per prompt, then the stream fails and the
trainer's next `get_batch` raises); a group that failed because the run's rewards all fail
(`RewardsFailed`, app/rewards/guard.py) fails the stream at once. A group started before a `restore` (stream generation) is dropped when
it finishes: its prompt is in the restored state.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from app.config import AlgorithmConfig
from app.records import Batch, Filtered, Group, Prompt
from app.rewards.guard import RewardsFailed
from app.rollout import admission, filtering
from app.rollout.generator import Frozen
from app.rollout.prompt_stream import PromptStream

log = logging.getLogger(__name__)

MAX_TRIES = 3

RunGroup = Callable[[Prompt, int], Awaitable[Group]]  # (prompt, seed) -> finished, scored group


class AsyncProducer:
    """Admission, the background producer and the queue of finished groups (one asyncio loop)."""

    def __init__(
        self,
        stream: PromptStream,
        run_group: RunGroup,
        algorithm: AlgorithmConfig,
        *,
        batch_groups: int,
        max_inflight: int,
        seed: int,
        stats: Counter[str] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """`algorithm`: the staleness bound, `over_bound` and `filter_groups`; `batch_groups` groups a
        training step (`train.batch_groups`), at most `max_inflight` generating (`rollout.max_inflight`);
        `seed` (the run's) seeds the groups' seeds."""
        self.stream, self.run_group, self.algorithm = stream, run_group, algorithm
        self.batch_groups, self.max_inflight = batch_groups, max_inflight
        self.stats: Counter[str] = stats if stats is not None else Counter()
        self.clock = clock
        self.version = 0  # the replicas' weight version (after the trainer's pushes)
        self.taken = 0  # groups handed to the trainer
        self.running = 0  # groups generating
        self.ready: collections.deque[Group] = collections.deque()
        self.attempts: Counter[str] = Counter()
        self.error: BaseException | None = None
        self.task: asyncio.Task | None = None
        self.changed: asyncio.Condition | None = None
        self.idle_since: float | None = None  # no group generating since (rollout idle time)
        self.idle_s = 0.0
        self.window_start = clock()
        self._rng = random.Random(seed * 1_000_003 + 7)

    # ------------------------------------------------------------ control

    def limit(self) -> int:
        return admission.admission_limit(self.algorithm.max_staleness, self.version, self.batch_groups)

    def _can_start(self) -> bool:
        return self.running < self.max_inflight and admission.can_admit(
            self.taken, len(self.ready), self.running, self.limit()
        )

    async def start(self) -> None:
        """Start the background producer (idempotent). Call after the trainer's first push."""
        if self.task is None:
            self.changed = self.changed or asyncio.Condition()
            self.idle_since = self.window_start = self.clock()
            self.task = asyncio.get_running_loop().create_task(self._produce())

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.task = None

    async def on_push(self, version: int) -> None:
        """The replicas now serve `version`: admission may start more groups."""
        self.version = max(self.version, version)
        await self._notify()

    def reset(self, ready: list[Group], taken: int, version: int) -> None:
        """After the stream's restore: the snapshot's finished groups queue first; counters continue."""
        self.stop()
        self.ready = collections.deque(ready)
        self.taken, self.version, self.running = taken, version, 0
        self.idle_since = self.clock()

    async def _notify(self) -> None:
        if self.changed is None:
            return
        async with self.changed:
            self.changed.notify_all()

    def _set_running(self, delta: int) -> None:
        now = self.clock()
        if self.running == 0 and delta > 0 and self.idle_since is not None:
            self.idle_s += now - self.idle_since
            self.idle_since = None
        self.running += delta
        if self.running == 0:
            self.idle_since = now

    # ------------------------------------------------------------ the background producer

    async def _produce(self) -> None:
        assert self.changed is not None
        try:
            while True:
                async with self.changed:
                    await self.changed.wait_for(self._can_start)
                gen = self.stream.generation
                # a Ray Data iterator blocks while it reads: keep the actor's loop free
                prompts = await asyncio.to_thread(self.stream.take, 1, gen)
                if (
                    not prompts
                ):  # the epochs are exhausted: only prompts sent back (failed, regenerated) remain
                    await self._notify()
                    async with self.changed:
                        await self.changed.wait_for(lambda: self.stream.has_retry)
                    continue
                self._set_running(+1)
                asyncio.get_running_loop().create_task(self._run(prompts[0], self._rng.randrange(2**31), gen))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the prompt stream itself failed (bad data): the trainer's get_batch raises
            self.error = e
            await self._notify()

    async def _run(self, prompt: Prompt, seed: int, gen: int) -> None:
        try:
            g = await self.run_group(prompt, seed)
            if (
                gen == self.stream.generation
            ):  # else a restore superseded it: its prompt is in the restored state
                self.ready.append(g)
        except Frozen as f:
            self.stream.keep_partial(f.key, f.samples)
        except RewardsFailed as e:  # no retry can help: the reward function fails on everything
            self.error = e
        except Exception as e:  # a failed group: its prompt goes back to the stream (MAX_TRIES tries)
            if gen != self.stream.generation:
                return
            self.attempts[prompt.uid] += 1
            self.stats["async/failed_groups"] += 1
            log.warning("group for prompt %s failed (try %d): %s", prompt.uid, self.attempts[prompt.uid], e)
            if self.attempts[prompt.uid] >= MAX_TRIES:
                self.error = RuntimeError(f"prompt {prompt.uid} failed {MAX_TRIES} times; last error: {e}")
            else:
                self.stream.retry(prompt)
        finally:
            if gen == self.stream.generation:
                self._set_running(-1)
                await self._notify()

    # ------------------------------------------------------------ the trainer's side

    async def get_batch(self, num_groups: int, version: int, timeout_s: float) -> Batch:
        """The next `num_groups` finished groups (FIFO by completion) for the trainer at `version`.

        Groups over the staleness bound are trained or regenerated per `over_bound` and counted; with
        `filter_groups`, a group without reward variance is dropped (returned in `Batch.filtered`) and the
        freed admission slot starts the next prompt, so the batch still gets `num_groups`. Returns
        fewer groups (possibly none) only when the data is exhausted and everything drained. Raises
        TimeoutError after `timeout_s` naming what the stream was doing.
        """
        self.changed = self.changed or asyncio.Condition()
        t0 = self.clock()
        deadline = time.monotonic() + timeout_s
        out: list[Group] = []
        drop: list[Filtered] = []
        over = 0
        gen = self.stream.generation
        while len(out) < num_groups:
            if (
                gen != self.stream.generation
            ):  # a trainer that died asked for this batch; its successor restored
                raise RuntimeError("this batch request was superseded by a restore from a checkpoint")
            if self.error is not None:
                raise RuntimeError(f"the rollout stream failed: {self.error}")
            if self.ready:
                g = self.ready.popleft()
                if admission.over_bound(version, g.min_version, self.algorithm.max_staleness):
                    over += 1
                    self.stats["async/over_bound"] += 1
                    if self.algorithm.over_bound == "regenerate":
                        self.stream.retry(g.prompt())
                        await self._notify()
                        continue
                if self.algorithm.filter_groups and not filtering.has_signal([s.reward for s in g.samples]):
                    drop.append(filtering.filtered(g))
                    self.stats["async/filtered_groups"] += 1
                    await self._notify()  # its admission slot is free: the next prompt starts
                    continue
                out.append(g)
                self.taken += 1
                await self._notify()
                continue
            if self.drained:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(self._timeout_report(timeout_s, num_groups, len(out)))
            async with self.changed:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), timeout=min(left, 1.0))
        return self._batch(out, over, t0, drop)

    @property
    def drained(self) -> bool:
        """The data is exhausted and every group generated and handed out."""
        return self.stream.exhausted and self.running == 0 and not self.stream.has_retry and not self.ready

    def _timeout_report(self, timeout_s: float, want: int, have: int) -> str:
        return (
            f"waited {timeout_s:.0f}s for {want} finished groups (have {have}): {self.running} generating, "
            f"{len(self.ready)} queued, {self.taken} taken, admission limit {self.limit()} at replica version "
            f"{self.version}, exhausted={self.stream.exhausted}"
        )

    def _batch(self, groups: list[Group], over: int, t0: float, drop: list[Filtered]) -> Batch:
        now = self.clock()
        idle = self.idle_s + (now - self.idle_since if self.idle_since is not None else 0.0)
        window = max(1e-9, now - self.window_start)
        self.idle_s, self.window_start = 0.0, now
        if self.idle_since is not None:
            self.idle_since = now
        return Batch(
            groups=groups,
            generate_s=now - t0,
            dropped_overlong=self.stream.dropped_overlong,
            reward_errors=reward_errors(self.stats),
            filtered=drop,
            extra={
                "async/queue_depth": float(len(self.ready)),
                "async/running": float(self.running),
                "async/rollout_idle_ratio": min(1.0, idle / window),
                "async/over_bound": float(self.stats["async/over_bound"]),
                "async/over_bound_batch": float(over),
                "async/failed_groups": float(self.stats["async/failed_groups"]),
                "async/resubmitted": float(self.stats["async/resubmitted"]),
                "async/off_regenerated": float(self.stats["async/off_regenerated"]),
                "async/filtered_groups": float(self.stats["async/filtered_groups"]),
            },
        )

    def progress(self) -> dict[str, Any]:
        return {
            "running": self.running,
            "queued": len(self.ready),
            "taken": self.taken,
            "replica_version": self.version,
        }


def reward_errors(stats: Counter[str]) -> dict[str, int]:
    """The reward and environment failure counters (and the bytes of reward output dropped past the cap),
    logged with every batch."""
    return {
        k: v
        for k, v in stats.items()
        if k.startswith(("reward/errors_", "env/errors_", "reward/output_dropped"))
    }
