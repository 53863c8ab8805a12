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
from typing import Any


def admission_limit(max_staleness: float, version: int, batch_groups: int) -> int:
    """How many groups may have been started (taken + queued + running) while the replicas serve `version`."""
    return math.floor((max_staleness + version + 1) * batch_groups + 1e-9)


def can_admit(taken: int, queued: int, running: int, limit: int) -> bool:
    """Whether one more group may start."""
    return taken + queued + running + 1 <= limit


def merge_partial(partial: dict[str, Any], continuation: dict[str, Any]) -> dict[str, Any]:
    """A sample aborted mid-generation plus its continuation (generated from prompt + partial response).

    Token ids, behaviour log-probs and per-token versions are concatenated, so every token keeps the
    version (and log-prob) of the policy that produced it; the finish reason is the continuation's.
    """
    for k in ("token_ids", "logprobs", "versions"):
        if len(partial[k]) != len(partial["token_ids"]) or len(continuation[k]) != len(
            continuation["token_ids"]
        ):
            raise ValueError(f"sample field {k!r} does not have one entry per token")
    return {
        **partial,
        "token_ids": list(partial["token_ids"]) + list(continuation["token_ids"]),
        "logprobs": list(partial["logprobs"]) + list(continuation["logprobs"]),
        "versions": list(partial["versions"]) + list(continuation["versions"]),
        "finish_reason": continuation["finish_reason"],
    }
