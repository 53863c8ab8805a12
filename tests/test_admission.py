"""Admission control and partial-rollout bookkeeping of the fully asynchronous mode (pure functions)."""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter

import pytest

from app.admission import admission_limit, can_admit, merge_partial, over_bound, staleness_bound
from app.records import Sample
from app.train_loop import staleness_by_length_decile


def test_admission_limit_hand_values():
    assert admission_limit(0, 0, 8) == 8  # sync: only batch 0 at version 0
    assert admission_limit(1, 0, 8) == 16  # one-step-off: batches 0 and 1
    assert admission_limit(0.5, 2, 8) == 28  # (0.5 + 2 + 1) * 8
    assert admission_limit(0.3, 0, 10) == 13  # floor(1.3 * 10), no float fuzz
    assert can_admit(taken=8, queued=4, running=3, limit=16)
    assert not can_admit(taken=8, queued=4, running=4, limit=16)


def test_merge_partial_keeps_versions_and_logprobs():
    part = {"token_ids": [5, 6], "logprobs": [-0.1, -0.2], "versions": [3, 3], "finish_reason": "abort"}
    cont = {"token_ids": [7], "logprobs": [-0.3], "versions": [4], "finish_reason": "stop"}
    m = merge_partial(part, cont)
    assert m["token_ids"] == [5, 6, 7] and m["logprobs"] == [-0.1, -0.2, -0.3]
    assert m["versions"] == [3, 3, 4] and m["finish_reason"] == "stop"
    with pytest.raises(ValueError, match="one entry per token"):
        merge_partial({**part, "versions": [3]}, cont)


def test_staleness_by_length_decile():
    def s(n, v):
        return Sample(list(range(n)), [0.0] * n, [v] * n, "stop")

    # lengths 1..10 (one sample per decile); the longer half was sampled two versions earlier
    samples = [s(n, 5 if n <= 5 else 3) for n in range(10, 0, -1)]
    assert staleness_by_length_decile(samples, 5) == [0.0] * 5 + [2.0] * 5
    # fewer than ten samples: one slice each
    assert staleness_by_length_decile([s(2, 4), s(1, 5)], 5) == [0.0, 1.0]


def _simulate(eta: float, durations, B: int = 4, steps: int = 30) -> int:
    """A discrete-event stream: groups take `durations()` each, finish into a FIFO queue, the trainer takes
    B finished groups, trains (0.3) and pushes; admission follows app.admission. Returns the worst
    staleness (trainer version minus the generating version) of a trained group."""
    t, version, taken, queued, running = 0.0, 0, 0, [], []
    worst, trained = 0, 0
    while trained < steps:
        limit = admission_limit(eta, version, B)
        while len(running) < 64 and can_admit(taken, len(queued), len(running), limit):
            heapq.heappush(running, (t + durations(), version))
        if len(queued) >= B:
            batch, queued = queued[:B], queued[B:]
            taken += B
            worst = max(worst, max(version - v for v in batch))
            version += 1
            trained += 1
            t += 0.3
            continue
        t, v = heapq.heappop(running)
        queued.append(v)
    return worst


@pytest.mark.parametrize("eta", [0, 1, 2, 0.5])
def test_admission_bounds_staleness_without_stragglers(eta):
    assert _simulate(eta, lambda: 1.0) <= math.ceil(eta)


def test_admission_with_stragglers():
    """eta = 0 is synchronous whatever the durations; with eta > 0 a group that finishes behind groups
    started after it can land in a later batch: that is what `algorithm.over_bound` handles and counts."""
    rng = random.Random(0)
    assert _simulate(0, lambda: rng.uniform(0.5, 5.0)) == 0
    assert _simulate(1, lambda: rng.choice([1.0, 1.0, 1.0, 9.0])) > 1


def _stream(
    rng: random.Random,
    n_prompts: int,
    epochs: int,
    B: int,
    eta: float,
    sync_every: int,
    max_inflight: int,
    durations,
    train_time,
) -> tuple[list[tuple[str, int]], int, int]:
    """The rollouter's fully_async policy as a discrete-event simulation with `over_bound=regenerate`.

    Mirrors app/rollouter.py: the producer admits a group while `can_admit` (and fewer than `max_inflight`
    generate); prompts come from a per-epoch shuffled stream, regenerated prompts first; finished groups
    queue FIFO; the trainer takes up to B groups (fewer only at the end of the data), regenerating those
    `over_bound`, trains, and pushes every `sync_every` steps. Checks the admission invariant at every
    admission; returns the trained (uid, epoch) list, the number of regenerations and the worst
    staleness of a trained group."""
    order = [[f"p{i}" for i in range(n_prompts)] for _ in range(epochs)]
    for o in order:
        rng.shuffle(o)
    stream = [(uid, e) for e, o in enumerate(order) for uid in o]
    retry: list[tuple[str, int]] = []
    t, trainer_version, replica_version, taken = 0.0, 0, 0, 0
    queued: list[tuple[str, int, int]] = []  # (uid, epoch, start version)
    running: list[tuple[float, int, tuple[str, int, int]]] = []
    trained: list[tuple[str, int]] = []
    regenerated, worst, seq = 0, 0, 0
    trainer_free_at = 0.0
    for _ in range(100_000):
        limit = admission_limit(eta, replica_version, B)
        while len(running) < max_inflight and can_admit(taken, len(queued), len(running), limit):
            if retry:
                uid, ep = retry.pop(0)
            elif stream:
                uid, ep = stream.pop(0)
            else:
                break
            seq += 1
            heapq.heappush(running, (t + durations(), seq, (uid, ep, replica_version)))
            assert taken + len(queued) + len(running) <= limit  # the admission invariant
        exhausted = not stream and not retry and not running
        if t >= trainer_free_at and (len(queued) >= B or (exhausted and queued)):
            batch = []
            while queued and len(batch) < B:
                g = queued.pop(0)
                if over_bound(trainer_version, g[2], eta):
                    regenerated += 1
                    retry.append(g[:2])
                    continue
                batch.append(g)
            if not batch:
                continue
            taken += len(batch)
            worst = max(worst, *(trainer_version - g[2] for g in batch))
            trained += [g[:2] for g in batch]
            trainer_version += 1
            if trainer_version % sync_every == 0:
                replica_version = trainer_version
            trainer_free_at = t + train_time()
            continue
        if exhausted and not queued:
            return trained, regenerated, worst
        nxt = [
            x
            for x in (running[0][0] if running else None, trainer_free_at if trainer_free_at > t else None)
            if x is not None
        ]
        assert nxt, "the simulated stream is wedged"
        t = min(nxt)
        while running and running[0][0] <= t:
            queued.append(heapq.heappop(running)[2])
    raise AssertionError("the simulated stream did not drain")


@pytest.mark.parametrize("seed", range(200))
def test_admission_random_orders_bound_and_exactly_once(seed):
    """Random arrival and finish orders (heavy-tailed generation times, random training times, batch
    sizes, bounds, push intervals, in-flight caps): with `over_bound=regenerate` no trained group exceeds
    the bound, the admission invariant holds at every start, and every prompt is trained exactly once per
    epoch."""
    rng = random.Random(seed)
    B = rng.choice([1, 2, 3, 4, 8])
    eta = rng.choice([0, 0.5, 1, 1.5, 2, 3])
    sync_every = rng.randint(1, max(1, math.floor(eta) + 1))
    n, epochs = rng.randint(1, 40), rng.randint(1, 3)
    tail = rng.choice([0.0, 0.1, 0.3])

    def durations():
        return rng.uniform(0.2, 1.0) * (rng.uniform(5, 30) if rng.random() < tail else 1.0)

    trained, regenerated, worst = _stream(
        rng, n, epochs, B, eta, sync_every, rng.randint(1, 64), durations, lambda: rng.uniform(0.01, 3.0)
    )
    assert worst <= staleness_bound(eta)
    assert Counter(trained) == Counter((f"p{i}", e) for i in range(n) for e in range(epochs))
    if eta == 0:
        assert regenerated == 0  # synchronous: nothing can be stale


def test_stragglers_are_regenerated_not_lost():
    """A heavy tail with eta = 1 does produce over-bound groups: they are regenerated, and still trained once."""
    rng = random.Random(1)
    trained, regenerated, worst = _stream(
        rng, 64, 1, 4, 1.0, 1, 32, lambda: rng.choice([1.0, 1.0, 1.0, 9.0]), lambda: 0.3
    )
    assert regenerated > 0 and worst <= 1
    assert sorted(u for u, _ in trained) == sorted(f"p{i}" for i in range(64))


def test_over_bound_hand_values():
    assert staleness_bound(0) == 0 and staleness_bound(0.5) == 1 and staleness_bound(2) == 2
    assert not over_bound(5, 4, 1) and over_bound(5, 3, 1) and not over_bound(5, 4, 0.5)
    assert over_bound(1, 0, 0)


def test_response_budget_is_long_tailed_and_deterministic():
    from app.admission import response_budget
    from app.config import parse_lengths

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
