"""The reward stage: trajectories are scored as they finish, on CPU workers, beside generation.

The rollouter sends each sample of a group as its own request; the moment one finishes, its reward starts
here while the rest of the group (and of the batch) is still generating, so a slow reward (compiling and
running tests in the sandbox, a math-equivalence check) overlaps generation instead of following it.

- `reward.workers = 0`: rewards run in the rollouter's own threads (fine for cheap rewards).
- `reward.workers = N`: N Ray actors (`reward.worker_cpus` logical CPUs each), each running up to
  `reward.max_concurrency` rewards at once; the pool sends each reward to the least busy worker.

Every reward has a deadline (`reward.timeout_s`, enforced in the worker, plus a margin here for a worker that
is itself stuck); an exception, a timeout, an invalid value or a dead worker scores `reward.on_error` and is
counted by kind (`reward/errors_exception`, `_timeout`, `_invalid`, `_crash`). A dead worker is restarted by
Ray. Nothing here raises into the rollout.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import asdict
from typing import Any

from app.rewards import RewardResult, resolve_reward_fn, score

log = logging.getLogger(__name__)

WORKER_MARGIN_S = 30.0  # beyond reward.timeout_s before a worker itself counts as stuck


class RewardWorker:
    """One CPU reward worker (a Ray actor): resolves reward functions once per data source, scores."""

    def __init__(self, spec: str, timeout_s: float, on_error: float) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self.spec, self.timeout_s, self.on_error = spec, timeout_s, on_error
        self.fns: dict[str, Any] = {}

    def pid(self) -> int:
        return os.getpid()

    async def score(self, data_source: str, text: str, answer: str) -> dict[str, Any]:
        if data_source not in self.fns:
            self.fns[data_source] = resolve_reward_fn(self.spec, data_source)
        res = await asyncio.to_thread(
            score, self.fns[data_source], text, answer, self.timeout_s, self.on_error
        )
        return asdict(res)


class RewardPool:
    """What the rollouter calls: `await pool.score(data_source, text, answer)` -> RewardResult."""

    def __init__(self, reward_cfg: Any, name_prefix: str) -> None:
        self.cfg = reward_cfg
        self.workers: list[Any] = []
        self.busy: list[int] = []
        self.fns: dict[str, Any] = {}
        n = int(reward_cfg.workers)
        if n > 0:
            import ray

            cls = ray.remote(RewardWorker)
            self.workers = [
                cls.options(
                    name=f"{name_prefix}-reward-{i}",
                    num_cpus=reward_cfg.worker_cpus,
                    max_concurrency=reward_cfg.max_concurrency,
                    max_restarts=-1,  # a worker killed by a hostile reward comes back
                    max_task_retries=0,  # ...but the reward that killed it is not retried: it scores on_error
                ).remote(reward_cfg.fn, reward_cfg.timeout_s, reward_cfg.on_error)
                for i in range(n)
            ]
            self.busy = [0] * n
        self.sem = asyncio.Semaphore(max(1, n) * max(1, int(reward_cfg.max_concurrency)))

    async def pids(self) -> list[int]:
        return [await w.pid.remote() for w in self.workers]

    async def score(self, data_source: str, text: str, answer: str) -> RewardResult:
        c = self.cfg
        async with self.sem:
            if not self.workers:
                if data_source not in self.fns:
                    self.fns[data_source] = resolve_reward_fn(c.fn, data_source)
                return await asyncio.to_thread(
                    score, self.fns[data_source], text, answer, c.timeout_s, c.on_error
                )
            i = min(range(len(self.workers)), key=self.busy.__getitem__)
            self.busy[i] += 1
            try:
                ref = self.workers[i].score.remote(data_source, text, answer)
                d = await asyncio.wait_for(ref, timeout=c.timeout_s + WORKER_MARGIN_S)
                return RewardResult(**d)
            except asyncio.TimeoutError:
                return RewardResult(
                    c.on_error, "timeout", f"reward worker {i} did not answer within {c.timeout_s}s + margin"
                )
            except Exception as e:
                import ray

                if isinstance(e, ray.exceptions.RayActorError):
                    log.warning("reward worker %d died while scoring (restarting): %s", i, e)
                    return RewardResult(c.on_error, "crash", f"reward worker {i} died: {type(e).__name__}")
                return RewardResult(c.on_error, "exception", f"{type(e).__name__}: {e}")
            finally:
                self.busy[i] -= 1
