"""A real RewardWorker actor on the shared cluster (`reward.workers=1`): a hostile math answer (an exponent
tower) scores `on_error` within the reward deadline, and the scoring process killed for it is gone; an
environment's blocking steps run on the worker and a worker killed mid-step fails the step, not the run."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from pathlib import Path

from app.config import load_config
from app.rewards.pool import RewardPool
from tests.test_reward_stage import TOWER_SLACK_S, TOWER_TIMEOUT_S, TOWERS, sample


def test_exponent_towers_time_out_in_a_ray_reward_worker(ray_cluster):
    import ray

    overrides = [
        "reward.fn=math",
        f"reward.timeout_s={TOWER_TIMEOUT_S}",
        "reward.on_error=-1",
        "reward.workers=1",
    ]
    cfg = load_config(None, overrides).reward

    pool = RewardPool(cfg, f"t{uuid.uuid4().hex[:8]}")

    async def run() -> tuple[list[tuple[float, str | None, float]], list[int]]:
        out = []
        for tower in TOWERS:
            assert (
                await pool.score(sample("\\boxed{2}", "2", "math"))
            ).score == 1.0  # warm worker and process
            t0 = time.monotonic()
            r = await pool.score(sample(tower, "1", "math"))
            out.append((r.score, r.error, time.monotonic() - t0))
        return out, await pool.workers[0].scorer_pids.remote()

    try:
        results, pids = asyncio.run(run())
    finally:
        for worker in pool.workers:  # the worker actor and, with it, its scoring processes
            ray.kill(worker)
    for score, error, elapsed in results:
        assert (score, error) == (-1.0, "timeout")
        assert elapsed < TOWER_TIMEOUT_S + TOWER_SLACK_S  # killed at the deadline (asserted below)
    killed = [-p for p in pids if p < 0]
    assert len(killed) == len(TOWERS)
    assert not any(os.path.exists(f"/proc/{p}") for p in killed)  # no abandoned computation burns CPU


def _mark_and_sleep(path: str, seconds: float) -> None:
    """An environment step that never ends by itself; it marks `path` once it runs."""
    Path(path).touch()
    time.sleep(seconds)


def test_environment_steps_run_on_the_reward_workers(ray_cluster, tmp_path):
    """`reward.workers=1`: the pool's `offload` (what environments get) runs a blocking function in the
    worker actor, not here; code_feedback's sandboxed tests run there and report as they do locally; a
    worker SIGKILLed mid-step raises (the episode scores on_error) instead of hanging, and Ray restarts it."""
    import ray

    from app.envs.code_feedback import CodeFeedbackEnv
    from app.records import Prompt
    from tests.test_code_feedback import PROBLEM, RIGHT, WRONG

    cfg = load_config(None, ["reward.workers=1"]).reward
    pool = RewardPool(cfg, f"t{uuid.uuid4().hex[:8]}")
    started = tmp_path / "started"
    prompt = Prompt(uid="c0", prompt_ids=[1], answer=PROBLEM.answer())

    async def run() -> tuple[int, int, list, BaseException | None, int]:
        (worker_pid,) = await pool.pids()
        ran_in = await pool.offload(os.getpid)
        env = CodeFeedbackEnv(offload=pool.offload)
        await env.reset(prompt)
        steps = [await env.step(WRONG), await env.step(RIGHT)]
        slow = asyncio.ensure_future(pool.offload(_mark_and_sleep, str(started), 60.0))
        deadline = time.monotonic() + 60
        while not started.exists():  # until the step is running in the worker (a loaded machine: seconds)
            assert time.monotonic() < deadline and not slow.done(), "the offloaded step never started"
            await asyncio.sleep(0.1)
        os.kill(worker_pid, signal.SIGKILL)
        try:
            await asyncio.wait_for(slow, timeout=30)
            err = None
        except Exception as e:  # the worker's death, as the episode would see it
            err = e
        deadline = time.monotonic() + 120  # restarted by Ray (max_restarts=-1), on a loaded machine too
        while True:
            try:
                back = await asyncio.wait_for(pool.offload(os.getpid), timeout=30)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
        return worker_pid, ran_in, steps, err, back

    try:
        worker_pid, ran_in, steps, err, back = asyncio.run(run())
    finally:
        for worker in pool.workers:
            ray.kill(worker)
    assert ran_in == worker_pid != os.getpid()
    first, second = steps
    assert not first.done and "ValueError" in first.observation and first.reward == 0.0
    assert second.done and second.reward == 1.0
    assert isinstance(err, ray.exceptions.RayActorError), err
    assert back not in (worker_pid, os.getpid())
