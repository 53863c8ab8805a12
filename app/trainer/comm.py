"""What the trainer ranks share and how rank 0 waits on the other roles (their handles: `Actors`, looked up
by name: `lookup_actors`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


def bcast(obj: Any) -> Any:
    """Rank 0's `obj` on every trainer rank (the default group), or `obj` itself without one."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def first_error(err: str | None) -> str | None:
    """The first rank's error among every trainer rank's `err` (None where every rank succeeded)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return err
    errs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errs, err)
    return next((f"rank {r}: {e}" for r, e in enumerate(errs) if e is not None), None)


@dataclass
class Actors:
    """Handles of the roles the trainer talks to, and its deadline (`train.timeout_s`) for their answers."""

    rollouter: Any
    hub: Any  # the weight hub: replica membership, the pushed version
    control: Any  # run control: stop requests, heartbeat
    timeout_s: float

    def get(self, ref: Any, what: str, slack: float = 0.0) -> Any:
        """`ray.get(ref)` within `timeout_s + slack`; past it, a TimeoutError saying what the roles were doing."""
        import ray

        try:
            return ray.get(ref, timeout=self.timeout_s + slack)
        except ray.exceptions.GetTimeoutError:
            prog, status = _answer(self.rollouter.progress.remote()), _answer(self.hub.status.remote())
            raise TimeoutError(
                f"waited train.timeout_s={self.timeout_s}s for {what}; rollouter={prog}; hub={status}"
            ) from None


def _answer(ref: Any, timeout_s: float = 10.0) -> Any:
    """`ray.get(ref)` for an error message: what went wrong instead, where it failed or took over `timeout_s`."""
    import ray

    try:
        return ray.get(ref, timeout=timeout_s)
    except Exception as e:
        return f"no answer within {timeout_s:g}s ({type(e).__name__})"
