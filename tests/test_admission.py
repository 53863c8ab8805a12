"""Admission control and partial-rollout bookkeeping of the fully asynchronous mode (pure functions)."""

from __future__ import annotations

import heapq
import math
import random

import pytest

from app.admission import admission_limit, can_admit, merge_partial
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
