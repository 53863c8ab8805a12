"""The reward stage: the pool's local mode, a worker's scoring, failures counted by kind, hostile math
inputs, the math-verify reward, sub-score metrics, the resource check; one Ray test (integration)."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from app.config import load_config
from app.infra.resources import ResourceError, check, demands
from app.records import Batch, GenerateRequest, GenerateResponse, Group, Prompt, Sample
from app.rewards import math_reward, resolve_reward_fn
from app.rewards.pool import FAST_REWARD_S, STARTUP_TIMEOUT_S, RewardPool, RewardProcesses, RewardWorker
from app.rewards.styles import RewardInput
from app.rollout import GroupGenerator
from app.trainer.batch_metrics import batch_metrics


def sample(response: str, answer: str, data_source: str = "x") -> RewardInput:
    """One sample to score (a row with only a data source)."""
    return RewardInput(response=response, answer=answer, data_source=data_source)


# The reward functions of these tests live in tests/test_rewards.py: the scoring processes import them, and
# this module's imports (app.records, the config) would cost each process time to start.
TOWERS = ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{2^{2^{40}}}", "\\boxed{10^{10^7}}"]
# Their reward deadline, and the most a killed one may take past it: they take minutes to compute, and on a
# loaded 2-core machine the kill and the reply take over a second.
TOWER_TIMEOUT_S = 2
TOWER_SLACK_S = 20


def test_pool_scores_concurrently_with_a_deadline_and_counts_failures():
    cfg = load_config(None, ["reward.fn=tests.test_rewards:slow_span", "reward.max_concurrency=8"]).reward

    async def run():
        pool = RewardPool(cfg, "t")
        try:
            await asyncio.gather(
                *[pool.score(sample("7", "7", "arith")) for _ in range(8)]
            )  # start 8 processes
            return await asyncio.gather(*[pool.score(sample("7", "7", "arith")) for _ in range(8)])
        finally:
            pool.close()

    res = asyncio.run(run())
    assert all(r.score == 1.0 and r.error is None for r in res)
    # eight 0.2 s rewards overlap (8 at once), not one after the other: some start before another ends
    spans = sorted((r.extras["start"], r.extras["end"]) for r in res)
    assert any(b_start < a_end for (_, a_end), (b_start, _) in itertools.pairwise(spans)), spans

    cfg = load_config(None, ["reward.fn=tests.test_rewards:boom", "reward.on_error=-1"]).reward
    r = asyncio.run(RewardPool(cfg, "t").score(sample("7", "7", "arith")))
    assert r.score == -1.0 and r.error == "exception"
    cfg = load_config(None, ["reward.fn=tests.test_rewards:slow", "reward.timeout_s=0.05"]).reward
    r = asyncio.run(RewardPool(cfg, "t").score(sample("7", "7", "arith")))
    assert r.error == "timeout" and r.score == 0.0


def test_exponent_towers_time_out_on_the_rollouter_path():
    """reward.workers=0: the path the rollouter awaits. sympy's big-integer powers hold the GIL; the
    deadline still holds (their scoring process is killed) and the event loop keeps running meanwhile."""
    cfg = load_config(
        None, ["reward.fn=math", f"reward.timeout_s={TOWER_TIMEOUT_S}", "reward.on_error=-1"]
    ).reward

    async def run() -> list[tuple[float, str | None, float, int]]:
        pool = RewardPool(cfg, "t")
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        tick = asyncio.create_task(ticker())
        out = []
        try:
            for tower in TOWERS:
                assert (await pool.score(sample("\\boxed{2}", "2", "math"))).score == 1.0  # warm process
                (procs,) = pool.procs.processes
                killed = len(procs.killed)
                t0, ticks = time.monotonic(), 0
                r = await pool.score(sample(tower, "1", "math"))
                out.append((r.score, r.error, time.monotonic() - t0, ticks, len(procs.killed) - killed))
        finally:
            tick.cancel()
            pool.close()
        return out

    for score, error, elapsed, ticks, kills in asyncio.run(run()):
        assert (score, error, kills) == (-1.0, "timeout", 1)  # its scoring process was killed at the deadline
        assert elapsed < TOWER_TIMEOUT_S + TOWER_SLACK_S
        assert ticks >= 10  # the loop ticked (every 50 ms) while the reward hung


def test_the_reward_after_a_killed_one_runs_in_a_warm_spare():
    """A reward that hangs is killed at its deadline; the next one runs in a process that was already up
    (the spare started when the first reward took the only process), not one started after the kill."""
    procs = RewardProcesses("tests.test_rewards:pid_or_hang", timeout_s=1.0, on_error=-1.0)
    try:
        assert procs.score(sample("a", "a")).score == 1.0
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:  # the spare starts in the background
            with procs.lock:
                warm = {p.proc.pid for p in procs.idle}
            if len(warm) >= 2:
                break
            assert time.monotonic() < deadline, "no spare reward process was started"
            time.sleep(0.05)
        hung = procs.score(sample("hang", "a"))
        assert hung.error == "timeout" and procs.killed[-1] in warm
        after = procs.score(sample("a", "a"))
        assert after.score == 1.0 and int(after.extras["pid"]) in warm - {procs.killed[-1]}
    finally:
        procs.close()


def test_a_fast_rewards_samples_share_one_request_and_a_hang_among_them_keeps_the_others():
    """`score_each`: a fast reward's samples go to one scoring process in one request, a reply each; the
    one that hangs is killed at its own deadline (one that ends its process is a crash), those before it
    keep their results and those after it are scored in another process."""
    procs = RewardProcesses("tests.test_rewards:pid_or_hang", timeout_s=1.0, on_error=-1.0)
    try:
        assert not procs.fast  # nothing timed yet
        assert procs.score(sample("a", "a")).score == 1.0
        assert procs.fast and procs.mean_s is not None and procs.mean_s < FAST_REWARD_S
        t0 = time.monotonic()
        got = procs.score_each([sample(r, "a") for r in ("a", "a", "hang", "a", "a")])
        assert time.monotonic() - t0 < 1.0 + TOWER_SLACK_S
        assert [(r.score, r.error) for r in got] == [(1.0, None)] * 2 + [(-1.0, "timeout")] + [
            (1.0, None)
        ] * 2
        pids = [int(r.extras.get("pid", 0)) for r in got]
        assert pids[0] == pids[1] == procs.killed[-1]  # the hung sample's process, killed
        assert pids[3] == pids[4] and pids[3] not in (0, pids[0])
        got = procs.score_each([sample(r, "a") for r in ("a", "die", "a")])  # the process dies mid-request
        assert [(r.score, r.error) for r in got] == [(1.0, None), (-1.0, "crash"), (1.0, None)]
        assert got[0].extras["pid"] != got[2].extras["pid"]  # the one after it, in another process
    finally:
        procs.close()


def test_the_generator_scores_a_fast_groups_samples_together_and_a_slow_ones_at_once():
    """rollout.group_requests: a group's samples come back together. With a fast reward (timed on the first
    samples) the rollouter scores them in one request to one scoring process; a slow one (0.2 s a sample)
    still scores them in parallel, a request each."""

    class GroupReplica:  # the generation is a fake: n samples a request, each answering "7"
        async def __call__(self, req: GenerateRequest) -> GenerateResponse:
            smp = [
                Sample(token_ids=[55], logprobs=[0.0], versions=[0], finish_reason="stop")
                for _ in range(req.n)
            ]
            return GenerateResponse(samples=smp, replica="r0")

    def run(fn: str) -> tuple[list[Sample], bool]:
        cfg = load_config(None, [f"reward.fn={fn}", "reward.max_concurrency=8"])
        pool = RewardPool(cfg.reward, "t")
        gen = GroupGenerator(
            GroupReplica(), lambda ids: "".join(map(chr, ids)), pool, cfg.rollout, reward=cfg.reward, seed=0
        )
        prompt = Prompt(uid="p", prompt_ids=[1, 2], answer="7", data_source="arith")

        async def go() -> tuple[list[Sample], bool]:
            await pool.score(sample("7", "7", "arith"))  # the reward timed on a first sample
            return (await gen.group(prompt, seed=0)).samples, pool.fast()

        try:
            return asyncio.run(go())
        finally:
            pool.close()

    samples, fast = run("tests.test_rewards:pid_or_hang")
    assert fast and len(samples) == 8 and all(s.reward == 1.0 for s in samples)
    assert len({s.reward_extras["pid"] for s in samples}) == 1  # one request, one process
    samples, fast = run("tests.test_rewards:slow_span")
    assert not fast and all(s.reward == 1.0 for s in samples)
    spans = sorted((s.reward_extras["start"], s.reward_extras["end"]) for s in samples)
    assert any(b_start < a_end for (_, a_end), (b_start, _) in itertools.pairwise(spans)), spans


def test_worker_returns_sub_scores():
    w = RewardWorker("tests.test_rewards:subscores", 5.0, 0.0)
    d = asyncio.run(w.score(sample("abc", "x", "arith")))
    assert d["score"] == 1.0 and d["extras"] == {"format": 0.5, "length": 3.0}
    w.procs.close()


def test_sub_scores_are_logged_as_batch_means():
    def s(extras):
        return Sample(
            token_ids=[1],
            logprobs=[0.0],
            versions=[0],
            finish_reason="stop",
            reward=1.0,
            reward_extras=extras,
        )

    samples = [s({"format": 1.0}), s({"format": 0.0, "len": 4.0})]
    b = Batch(groups=[Group(uid="g", prompt_ids=[1], answer="a", samples=samples)])
    m = batch_metrics(b)
    assert m["reward/sub/format"] == 0.5 and m["reward/sub/len"] == 4.0


@pytest.mark.parametrize(
    "response,answer,want",
    [
        ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("The result: $0.5$", "\\frac{1}{2}", 1.0),
        ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
        ("\\boxed{42}", "41", 0.0),
        ("I do not know", "3", 0.0),
    ],
)
def test_math_reward_equivalence(response, answer, want):
    assert math_reward(response, answer) == want


def test_auto_picks_math_for_math_sources():
    assert resolve_reward_fn("auto", "MATH-500") is math_reward
    assert resolve_reward_fn("math") is math_reward


def test_resource_check_names_every_role():
    cfg = load_config(
        None,
        [
            "rollout.max_replicas=4",
            "rollout.replica_gpus=1",
            "train.use_gpu=true",
            "train.workers=2",
            "algorithm.kl_coef=0.1",
            "ref.workers=1",
            "ref.worker_gpus=1",
            "reward.workers=2",
        ],
    )
    d = demands(cfg)
    assert d["rollout"]["GPU"] == 4 and d["train"]["GPU"] == 2 and d["reference"]["GPU"] == 1
    assert d["reward"]["CPU"] == 1.0
    check(cfg, {"CPU": 64, "GPU": 8})
    with pytest.raises(
        ResourceError, match=r"7 GPU asked \(rollout 4, train 2, reference 1\) but the cluster has 4"
    ):
        check(cfg, {"CPU": 64, "GPU": 4})


def test_async_reward_functions_are_awaited():
    w = RewardWorker("tests.test_rewards:async_judge", 5.0, 0.0)
    d = asyncio.run(w.score(sample("7", "7", "arith")))
    assert d["score"] == 1.0 and d["error"] is None and d["extras"] == {"judge": 0.25}
    w.procs.close()


def test_resource_shares_resolve_to_per_role_settings():
    from app.infra.resources import resolve

    cfg = load_config(
        None,
        [
            "rollout.max_replicas=2",
            "ref.workers=2",
            "algorithm.kl_coef=0.1",
            "resources.rollout_gpus=4",
            "resources.train_gpus=2",
            "resources.ref_gpus=0.25",
            "resources.reward_cpus=0.5",
            "reward.workers=4",
        ],
    )
    got = resolve(cfg, {"CPU": 64, "GPU": 8})
    assert got == {
        "rollout.replica_gpus": 2.0,  # 4 GPUs over 2 replicas
        "ref.worker_gpus": 1.0,  # a quarter of 8 GPUs over 2 workers
        "reward.worker_cpus": 8.0,  # half of 64 CPUs over 4 workers
        "train.use_gpu": True,
        "train.workers": 2,
    }
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"{k}={v}" for k, v in got.items()]))
    check(merged, {"CPU": 64, "GPU": 8})  # 4 + 2 + 2 GPUs: fits exactly
    with pytest.raises(ResourceError, match="whole number"):
        resolve(load_config(None, ["resources.train_gpus=0.3"]), {"CPU": 8, "GPU": 8})
    assert resolve(load_config(None, []), {"CPU": 8}) == {}
