"""Admission control of the fully asynchronous mode: the pure functions, and the real `AsyncProducer` with the
real `PromptStream` and `GroupGenerator` driven by a fake generation (heavy-tailed asyncio sleeps) and a fake
trainer, over many seeded random setups."""

from __future__ import annotations

import asyncio
import math
import random
from collections import Counter

import pytest

from app.config import AlgorithmConfig, RewardConfig, RolloutConfig
from app.records import GenerateRequest, GenerateResponse, Prompt, Sample
from app.rewards import RewardResult
from app.rewards.styles import RewardInput
from app.rollout import AsyncProducer, GroupGenerator, PromptStream
from app.rollout.admission import (
    admission_limit,
    can_admit,
    merge_partial,
    older_than_newest,
    over_bound,
    staleness_bound,
)
from app.trainer.batch_metrics import staleness_by_length_decile


def test_admission_limit_hand_values():
    assert admission_limit(0, 0, 8) == 8  # sync: only batch 0 at version 0
    assert admission_limit(1, 0, 8) == 16  # one-step-off: batches 0 and 1
    assert admission_limit(0.5, 2, 8) == 28  # (0.5 + 2 + 1) * 8
    assert admission_limit(0.3, 0, 10) == 13  # floor(1.3 * 10), no float fuzz
    assert can_admit(taken=8, queued=4, running=3, limit=16)
    assert not can_admit(taken=8, queued=4, running=4, limit=16)


def test_merge_partial_keeps_versions_and_logprobs():
    part = Sample(
        token_ids=[5, 6], logprobs=[-0.1, -0.2], versions=[3, 3], finish_reason="abort", replica="r1"
    )
    cont = Sample(token_ids=[7], logprobs=[-0.3], versions=[4], finish_reason="stop", replica="r2")
    m = merge_partial(part, cont)
    assert m.token_ids == [5, 6, 7] and m.logprobs == [-0.1, -0.2, -0.3]
    assert m.versions == [3, 3, 4] and m.finish_reason == "stop" and m.replica == "r1"
    assert part.token_ids == [5, 6]  # the partial itself is left as it was
    part.versions = [3]  # a sample mutated out of shape: the merged one is checked again
    with pytest.raises(ValueError, match="one version per token"):
        merge_partial(part, cont)


def test_older_than_newest_hand_values():
    def smp(*versions: int) -> Sample:
        return Sample(
            token_ids=[1] * len(versions),
            logprobs=[0.0] * len(versions),
            versions=list(versions),
            finish_reason="stop",
        )

    assert older_than_newest([smp(2, 2), smp(3), smp(), smp(2, 3), smp(3, 3)]) == [0, 3]
    assert older_than_newest([smp(1), smp(1, 1)]) == []  # one version: nothing to generate again
    assert older_than_newest([smp(), smp()]) == []  # no tokens, no versions


def test_staleness_by_length_decile():
    def s(n, v):
        return Sample(token_ids=list(range(n)), logprobs=[0.0] * n, versions=[v] * n, finish_reason="stop")

    # lengths 1..10 (one sample per decile); the longer half was sampled two versions earlier
    samples = [s(n, 5 if n <= 5 else 3) for n in range(10, 0, -1)]
    assert staleness_by_length_decile(samples, 5) == [0.0] * 5 + [2.0] * 5
    # fewer than ten samples: one slice each
    assert staleness_by_length_decile([s(2, 4), s(1, 5)], 5) == [0.0, 1.0]


UNIT_S = 0.0002  # one simulated time unit: the orders of finishing are what matter, not the durations


async def _stream(
    seed: int,
    *,
    n_prompts: int,
    epochs: int,
    B: int,
    eta: float,
    sync_every: int,
    max_inflight: int,
    over_bound: str,
    durations,
    train_time,
    n: int = 1,
    filter_groups: bool = False,
    answer=lambda i: "1",
    filtered: list[tuple[str, int]] | None = None,
) -> tuple[list[tuple[str, int]], int, int]:
    """Runs the real producer against a fake trainer until the data drains.

    The fake generation checks the admission invariant whenever a group's sample starts, labels its tokens
    with the version the replicas serve at its start, and sleeps `durations()` units; the fake trainer takes
    B groups (fewer only at the end of the data), acknowledges them, trains `train_time()` units and pushes
    every `sync_every` steps. Returns the trained (uid, epoch) list, the over-bound count and the worst
    staleness of a trained group; groups dynamic sampling dropped go to `filtered`. A sample's second token
    is its seed's parity; a prompt whose answer is `parity` is rewarded by it, any other always 1."""
    prompts = [Prompt(uid=f"p{i}", prompt_ids=[1 + i % 7], answer=answer(i)) for i in range(n_prompts)]

    def epoch_rows(epoch: int):
        order = list(prompts)
        random.Random(seed * 1000 + epoch).shuffle(order)  # a per-epoch shuffle, as the rollouter's
        return iter(order)

    stream = PromptStream(epoch_rows, epochs=epochs)
    served = {"version": 0}
    producer: AsyncProducer | None = None

    async def generate(req: GenerateRequest) -> GenerateResponse:
        p = producer
        assert p.taken + len(p.ready) + p.running <= admission_limit(eta, p.version, B)  # the invariant
        v = served["version"]
        await asyncio.sleep(durations() * UNIT_S)
        parity = 4 + (req.seed or 0) % 2
        smp = Sample(token_ids=[3, parity], logprobs=[-0.5, -0.5], versions=[v, v], finish_reason="stop")
        return GenerateResponse(samples=[smp], replica="fake", version=v)

    async def score(inp: RewardInput) -> RewardResult:
        return RewardResult(score=float(inp.response.endswith("5")) if inp.answer == "parity" else 1.0)

    rollout = RolloutConfig(n=n, max_tokens=4, group_requests=False)  # the fake answers one sample a request
    gen = GroupGenerator(
        generate, lambda ids: " ".join(map(str, ids)), score, rollout, reward=RewardConfig(), seed=seed
    )
    algorithm = AlgorithmConfig(max_staleness=eta, over_bound=over_bound, filter_groups=filter_groups)
    producer = AsyncProducer(
        stream,
        lambda p, s: gen.group(p, seed=s),
        algorithm,
        batch_groups=B,
        max_inflight=max_inflight,
        seed=seed,
    )
    await producer.start()
    trained: list[tuple[str, int]] = []
    version, worst = 0, 0
    try:
        while True:
            batch = await producer.get_batch(B, version, timeout_s=20)
            if filtered is not None:
                filtered += [(f.uid, f.epoch) for f in batch.filtered]
            if not batch.groups:  # the data ran out (groups dropped while making this batch still settle)
                stream.ack([f.key for f in batch.filtered])
                break
            assert len(batch.groups) == B or producer.drained  # a short batch only at the end of the data
            worst = max(worst, *(version - g.min_version for g in batch.groups))
            trained += [(g.uid, g.epoch) for g in batch.groups]
            assert not filter_groups or all(len({s.reward for s in g.samples}) > 1 for g in batch.groups)
            stream.ack([g.key for g in batch.groups] + [f.key for f in batch.filtered])
            await asyncio.sleep(train_time() * UNIT_S)
            version += 1
            if version % sync_every == 0:
                served["version"] = version
                await producer.on_push(version)
    finally:
        producer.stop()
    assert not stream.outstanding  # every prompt taken was trained and acknowledged
    return trained, producer.stats["async/over_bound"], worst


@pytest.mark.parametrize("eta", [0, 1, 2, 0.5])
def test_admission_bounds_staleness_without_stragglers(eta):
    trained, _, worst = asyncio.run(
        _stream(
            0,
            n_prompts=24,
            epochs=1,
            B=4,
            eta=eta,
            sync_every=1,
            max_inflight=64,
            over_bound="train",
            durations=lambda: 1.0,
            train_time=lambda: 0.3,
        )
    )
    assert worst <= math.ceil(eta) and len(trained) == 24


def test_admission_with_stragglers():
    """eta = 0 is synchronous whatever the durations; with eta > 0 a group that finishes behind groups
    started after it can land in a later batch: `algorithm.over_bound=train` trains it and counts it."""
    rng = random.Random(0)
    common = dict(n_prompts=48, epochs=1, B=4, sync_every=1, max_inflight=64, over_bound="train")
    _, over, worst = asyncio.run(
        _stream(0, eta=0, durations=lambda: rng.uniform(0.5, 5.0), train_time=lambda: 0.3, **common)
    )
    assert worst == 0 and over == 0
    _, over, worst = asyncio.run(
        _stream(
            1, eta=1, durations=lambda: rng.choice([1.0, 1.0, 1.0, 20.0]), train_time=lambda: 0.3, **common
        )
    )
    assert worst > 1 and over > 0


async def _random_setups(seeds: range) -> None:
    for seed in seeds:
        rng = random.Random(seed)
        B = rng.choice([1, 2, 3, 4, 8])
        eta = rng.choice([0, 0.5, 1, 1.5, 2, 3])
        sync_every = rng.randint(1, max(1, math.floor(eta) + 1))
        n_prompts, epochs = rng.randint(1, 30), rng.randint(1, 3)
        tail = rng.choice([0.0, 0.1, 0.3])

        def durations(rng=rng, tail=tail) -> float:
            return rng.uniform(0.2, 1.0) * (rng.uniform(5, 30) if rng.random() < tail else 1.0)

        trained, over, worst = await _stream(
            seed,
            n_prompts=n_prompts,
            epochs=epochs,
            B=B,
            eta=eta,
            sync_every=sync_every,
            max_inflight=rng.randint(1, 64),
            over_bound="regenerate",
            durations=durations,
            train_time=lambda rng=rng: rng.uniform(0.01, 3.0),
            n=rng.choice([1, 2]),
        )
        setup = f"seed {seed}: B={B} eta={eta} sync_every={sync_every} prompts={n_prompts} epochs={epochs}"
        assert worst <= staleness_bound(eta), setup
        assert Counter(trained) == Counter((f"p{i}", e) for i in range(n_prompts) for e in range(epochs)), (
            setup
        )
        if eta == 0:
            assert over == 0, setup  # synchronous: nothing can be stale


@pytest.mark.parametrize("block", range(4))
def test_admission_random_orders_bound_and_exactly_once(block):
    """Random arrival and finish orders (heavy-tailed generation times, random training times, batch
    sizes, bounds, push intervals, in-flight caps, group sizes): with `over_bound=regenerate` no trained
    group exceeds the bound, the admission invariant holds at every start, and every prompt is trained
    exactly once per epoch."""
    asyncio.run(_random_setups(range(block * 20, block * 20 + 20)))


def test_stragglers_are_regenerated_not_lost():
    """A heavy tail with eta = 1 does produce over-bound groups: by default (`algorithm.over_bound`) they are
    regenerated, and still trained once: no trained token is older than the bound."""
    assert AlgorithmConfig().over_bound == "regenerate"
    rng = random.Random(1)
    trained, over, worst = asyncio.run(
        _stream(
            1,
            n_prompts=64,
            epochs=1,
            B=4,
            eta=1.0,
            sync_every=1,
            max_inflight=32,
            over_bound="regenerate",
            durations=lambda: rng.choice([1.0, 1.0, 1.0, 20.0]),
            train_time=lambda: 0.3,
        )
    )
    assert over > 0 and worst <= 1
    assert sorted(u for u, _ in trained) == sorted(f"p{i}" for i in range(64))


def test_over_bound_hand_values():
    assert staleness_bound(0) == 0 and staleness_bound(0.5) == 1 and staleness_bound(2) == 2
    assert not over_bound(5, 4, 1) and over_bound(5, 3, 1) and not over_bound(5, 4, 0.5)
    assert over_bound(1, 0, 0)


def test_response_budget_is_long_tailed_and_deterministic():
    from app.config import parse_lengths
    from app.rollout.admission import response_budget

    assert parse_lengths("fixed") is None and parse_lengths("pareto:1.2:4") == (1.2, 4)
    for bad in ("pareto:1.2", "lognormal:1:2", "pareto:0:4", "pareto:x:4"):
        with pytest.raises(ValueError, match="ALPHA"):
            parse_lengths(bad)
    assert response_budget(None, "p1", 0, 96) == 96
    lens = [response_budget((1.2, 4), f"p{i}", 0, 96) for i in range(2000)]
    assert lens == [response_budget((1.2, 4), f"p{i}", 0, 96) for i in range(2000)]  # same in every mode
    assert min(lens) >= 4 and max(lens) == 96
    lens.sort()
    median, p95 = lens[1000], lens[1900]
    assert median <= 8 and p95 >= 40  # most groups are short, a few run to the cap


@pytest.mark.parametrize("eta", [0, 1])
def test_dynamic_sampling_drops_groups_without_signal_and_keeps_the_batch_full(eta):
    """`filter_groups`: every third prompt's group is rewarded 1 whatever it says (no variance): it is not
    trained but returned as filtered; the batch stays B groups (short only at the end of the data), and each
    prompt of each epoch is trained or filtered exactly once."""
    filtered: list[tuple[str, int]] = []
    trained, _, worst = asyncio.run(
        _stream(
            3,
            n_prompts=30,
            epochs=2,
            B=4,
            eta=eta,
            sync_every=1,
            max_inflight=16,
            over_bound="regenerate",
            durations=lambda: 1.0,
            train_time=lambda: 0.3,
            n=2,
            filter_groups=True,
            answer=lambda i: "1" if i % 3 == 0 else "parity",
            filtered=filtered,
        )
    )
    assert sorted(filtered) == sorted((f"p{i}", e) for i in range(0, 30, 3) for e in range(2))
    assert sorted(trained) == sorted((f"p{i}", e) for i in range(30) if i % 3 for e in range(2))
    assert worst <= staleness_bound(eta)
