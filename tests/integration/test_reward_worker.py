"""A real RewardWorker actor on the shared cluster (`reward.workers=1`): a hostile math answer (an exponent
tower) scores `on_error` within the reward deadline, and the scoring process killed for it is gone."""

from __future__ import annotations

import asyncio
import os
import time
import uuid

from app.config import load_config
from app.reward_pool import RewardPool
from tests.test_reward_stage import TOWERS


def test_exponent_towers_time_out_in_a_ray_reward_worker(ray_cluster):
    import ray

    overrides = ["reward.fn=math", "reward.timeout_s=2", "reward.on_error=-1", "reward.workers=1"]
    cfg = load_config(None, overrides).reward

    pool = RewardPool(cfg, f"t{uuid.uuid4().hex[:8]}")

    async def run() -> tuple[list[tuple[float, str | None, float]], list[int]]:
        out = []
        for tower in TOWERS:
            assert (await pool.score("math", "\\boxed{2}", "2")).score == 1.0  # warm worker and process
            t0 = time.monotonic()
            r = await pool.score("math", tower, "1")
            out.append((r.score, r.error, time.monotonic() - t0))
        return out, await pool.workers[0].scorer_pids.remote()

    try:
        results, pids = asyncio.run(run())
    finally:
        for worker in pool.workers:  # the worker actor and, with it, its scoring processes
            ray.kill(worker)
    for score, error, elapsed in results:
        assert (score, error) == (-1.0, "timeout")
        assert elapsed < 2 + 1
    killed = [-p for p in pids if p < 0]
    assert len(killed) == len(TOWERS)
    assert not any(os.path.exists(f"/proc/{p}") for p in killed)  # no abandoned computation burns CPU
