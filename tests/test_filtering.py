"""Dynamic sampling's pure part (`app.rollout.filtering`), with hand-made groups."""

from __future__ import annotations

import asyncio

from app.records import Group, Sample
from app.rollout.filtering import fill, has_signal, split


def _group(uid: str, rewards: list[float], epoch: int = 0) -> Group:
    samples = [
        Sample(token_ids=[1], logprobs=[-0.1], versions=[0], finish_reason="stop", reward=r) for r in rewards
    ]
    return Group(uid=uid, prompt_ids=[1], answer="1", samples=samples, epoch=epoch)


def test_has_signal_hand_values():
    assert has_signal([0.0, 1.0])
    assert has_signal([0.5, 0.5, 0.5, 0.6])
    assert not has_signal([1.0, 1.0, 1.0])
    assert not has_signal([0.0, 0.0])
    assert not has_signal([0.3, 0.3 + 1e-9])  # float noise of summed partial credits is no signal
    assert not has_signal([1.0])  # one sample never has variance
    assert not has_signal([])


def test_split_keeps_order_and_describes_the_dropped():
    gs = [_group("a", [1, 1]), _group("b", [0, 1]), _group("c", [0, 0], epoch=2), _group("d", [1, 0])]
    keep, drop = split(gs, enabled=True)
    assert [g.uid for g in keep] == ["b", "d"]
    assert [(f.uid, f.epoch, f.reward, f.key) for f in drop] == [("a", 0, 1.0, "0:a"), ("c", 2, 0.0, "2:c")]
    keep, drop = split(gs, enabled=False)
    assert keep == gs and drop == []


def test_fill_refills_until_the_batch_has_signal_or_the_data_ends():
    """The sync modes' batch: dropped groups are replaced by asking for as many fresh ones, in order."""
    data = [_group(f"p{i}", [1, 1] if i % 3 == 0 else [0, 1]) for i in range(10)]
    asked: list[int] = []

    async def fresh(k: int) -> list[Group]:
        asked.append(k)
        got, data[:k] = data[:k], []
        return got

    restored = [_group("r", [0, 0])]
    keep, drop = asyncio.run(fill(4, restored, fresh, enabled=True))
    assert [g.uid for g in keep] == ["p1", "p2", "p4", "p5"]
    assert [f.uid for f in drop] == ["r", "p0", "p3"]
    assert asked == [4, 2]  # r dropped: 4 asked; p0 and p3 dropped: 2 more
    keep, drop = asyncio.run(fill(4, [], fresh, enabled=True))  # p6..p9 left: p6 and p9 have no signal
    assert [g.uid for g in keep] == ["p7", "p8"] and [f.uid for f in drop] == ["p6", "p9"]
    assert asked[2:] == [4, 2]  # the second ask found the data exhausted: a short batch
    keep, drop = asyncio.run(fill(2, [], fresh, enabled=True))
    assert keep == [] and drop == []
