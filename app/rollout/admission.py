"""Pure functions of the fully asynchronous pipeline: admission control and partial-rollout bookkeeping.

Admission (AReaL's rule): with `B` groups per batch, a staleness bound `eta` (in versions, fractions allowed)
and replicas serving version `v`, a new group may start only while

    taken + queued + running + 1 <= floor((eta + v + 1) * B)

Groups are trained in batches of B, so the group that makes the count `c` lands in batch `ceil(c / B) - 1`,
which the trainer trains at version `ceil(c / B) - 1`; the rule makes that at most `v + eta`: every
group starts at most `eta` versions before the version that trains it. `eta = 0` is synchronous training,
`eta = 1` one-step-off. A group that finishes late (a straggler) can still exceed the bound; the caller
decides what to do with it and counts it.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

from app.records import Sample


def admission_limit(max_staleness: float, version: int, batch_groups: int) -> int:
    """How many groups may have been started (taken + queued + running) while the replicas serve `version`."""
    return math.floor((max_staleness + version + 1) * batch_groups + 1e-9)


def can_admit(taken: int, queued: int, running: int, limit: int) -> bool:
    """Whether one more group may start."""
    return taken + queued + running + 1 <= limit


def staleness_bound(max_staleness: float) -> int:
    """The staleness (in whole versions) a single trained group may have: fractional bounds limit how many
    groups run ahead, one group's bound is their ceiling."""
    return math.ceil(max_staleness - 1e-9)


def over_bound(train_version: int, group_min_version: int, max_staleness: float) -> bool:
    """Whether a group whose oldest token came from `group_min_version` exceeds the bound when trained at
    `train_version` (a straggler: `algorithm.over_bound` decides whether it is trained or regenerated)."""
    return train_version - group_min_version > staleness_bound(max_staleness)


def response_budget(lengths: tuple[float, int] | None, uid: str, seed: int, max_tokens: int) -> int:
    """max_tokens of one prompt group: `max_tokens`, or a long-tailed draw min(max_tokens, MIN x Pareto(ALPHA))
    that depends only on (seed, uid), so every mode of a benchmark sees the same lengths."""
    if lengths is None:
        return max_tokens
    alpha, low = lengths
    rng = random.Random(f"{seed}:{uid}")
    return max(1, min(max_tokens, int(low * rng.paretovariate(alpha))))


def older_than_newest(samples: list[Sample]) -> list[int]:
    """The indices of the samples with a token older than the newest version any sample of the group holds
    (`rollout.partial=off` generates those again, so that the group comes from one policy version). A sample
    without tokens carries no version and is never older."""
    newest = max((v for s in samples for v in s.versions), default=-1)
    return [i for i, s in enumerate(samples) if s.versions and min(s.versions) < newest]


def merge_partial(partial: Sample, continuation: Sample) -> Sample:
    """A sample aborted mid-generation plus its continuation (generated from prompt + partial response).

    Token ids, behaviour log-probs and per-token versions are concatenated, so every token keeps the
    version (and log-prob) of the policy that produced it; the finish reason is the continuation's. The
    merged sample is built anew, so `Sample`'s check (one log-prob and one version per token) runs on it.
    """
    return replace(
        partial,
        token_ids=list(partial.token_ids) + list(continuation.token_ids),
        logprobs=list(partial.logprobs) + list(continuation.logprobs),
        versions=list(partial.versions) + list(continuation.versions),
        finish_reason=continuation.finish_reason,
    )
