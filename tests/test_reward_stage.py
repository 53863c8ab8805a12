"""The reward stage without Ray: the pool's local mode, a worker's scoring, failures counted by kind, the
math-verify reward, sub-score metrics, and the resource check."""

from __future__ import annotations

import asyncio
import time

import pytest

from app.config import load_config
from app.records import Batch, Group, Sample
from app.resources import ResourceError, check, demands
from app.reward_pool import RewardPool, RewardWorker
from app.rewards import math_reward, resolve_reward_fn
from app.train_loop import batch_metrics


def slow(response: str, answer: str) -> float:
    time.sleep(0.2)
    return float(response == answer)


def boom(response: str, answer: str) -> float:
    raise RuntimeError("reward crashed")


def subscores(response: str, answer: str) -> dict:
    return {"score": 1.0, "format": 0.5, "length": float(len(response))}


def test_pool_scores_concurrently_with_a_deadline_and_counts_failures():
    cfg = load_config(None, ["reward.fn=tests.test_reward_stage:slow", "reward.max_concurrency=8"]).reward

    async def run():
        pool = RewardPool(cfg, "t")
        t0 = time.perf_counter()
        res = await asyncio.gather(*[pool.score("arith", "7", "7") for _ in range(8)])
        return res, time.perf_counter() - t0

    res, dt = asyncio.run(run())
    assert all(r.score == 1.0 and r.error is None for r in res)
    assert dt < 0.2 * 8 / 2  # eight 0.2 s rewards overlap (8 at once), not one after the other

    cfg = load_config(None, ["reward.fn=tests.test_reward_stage:boom", "reward.on_error=-1"]).reward
    r = asyncio.run(RewardPool(cfg, "t").score("arith", "7", "7"))
    assert r.score == -1.0 and r.error == "exception"
    cfg = load_config(None, ["reward.fn=tests.test_reward_stage:slow", "reward.timeout_s=0.05"]).reward
    r = asyncio.run(RewardPool(cfg, "t").score("arith", "7", "7"))
    assert r.error == "timeout" and r.score == 0.0


def test_worker_returns_sub_scores():
    w = RewardWorker("tests.test_reward_stage:subscores", 5.0, 0.0)
    d = asyncio.run(w.score("arith", "abc", "x"))
    assert d["score"] == 1.0 and d["extras"] == {"format": 0.5, "length": 3.0}


def test_sub_scores_are_logged_as_batch_means():
    def s(extras):
        return Sample([1], [0.0], [0], "stop", reward=1.0, reward_extras=extras)

    b = Batch([Group("g", [1], "a", [s({"format": 1.0}), s({"format": 0.0, "len": 4.0})])])
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


async def async_reward(response: str, answer: str) -> dict:
    await asyncio.sleep(0.01)
    return {"score": float(response == answer), "judge": 0.25}


def test_async_reward_functions_are_awaited():
    from app.rewards import score

    fn = resolve_reward_fn("tests.test_reward_stage:async_reward")
    r = score(fn, "7", "7", 5.0, 0.0)
    assert r.score == 1.0 and r.error is None and r.extras == {"judge": 0.25}


def test_resource_shares_resolve_to_per_role_settings():
    from app.resources import resolve

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
