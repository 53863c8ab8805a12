"""DAPO's dynamic sampling (`algorithm.filter_groups`): a group whose samples all got the same reward carries
no learning signal (every group-relative advantage is 0), so it is dropped and its place in the batch goes to
the next group from the stream. Pure functions; the producers (sync batches, the fully_async queue) call them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence

from app.records import Filtered, Group

EPS = 1e-6  # rewards closer than this are equal (sums of float partial credits)


def has_signal(rewards: Sequence[float], eps: float = EPS) -> bool:
    """True when the rewards are not all equal (a group of one sample has none)."""
    return len(rewards) > 1 and max(rewards) - min(rewards) > eps


def filtered(g: Group) -> Filtered:
    rewards = [s.reward for s in g.samples]
    return Filtered(uid=g.uid, epoch=g.epoch, reward=sum(rewards) / max(1, len(rewards)))


def split(groups: Iterable[Group], enabled: bool) -> tuple[list[Group], list[Filtered]]:
    """(groups to train, groups dropped) in order; with `enabled` false every group is kept."""
    keep: list[Group] = []
    drop: list[Filtered] = []
    for g in groups:
        if not enabled or has_signal([s.reward for s in g.samples]):
            keep.append(g)
        else:
            drop.append(filtered(g))
    return keep, drop


async def fill(
    want: int, first: list[Group], fresh: Callable[[int], Awaitable[list[Group]]], enabled: bool
) -> tuple[list[Group], list[Filtered]]:
    """A batch of `want` groups for the sync modes: `first` (restored from a checkpoint), then `fresh(k)`
    (k new prompts generated and scored; fewer or none once the data runs out) until `want` have a signal."""
    keep, drop = split(first, enabled)
    while len(keep) < want:
        got = await fresh(want - len(keep))
        if not got:  # the data is exhausted: a short batch
            break
        more, dropped = split(got, enabled)
        keep, drop = keep + more, drop + dropped
    return keep, drop
