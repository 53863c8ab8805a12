"""The broadcast transport's ordering contract on both ends, against a recording weight group (the NCCL
boundary): on a device-ordered receive the host waits, under the deadline, only for the last bucket, and the
next bucket's broadcast is always posted before the previous bucket is loaded."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from app.vllm.fast_load import SlotLoader
from app.weights.broadcast import receive_buckets, send_buckets
from app.weights.buckets import checksum, device_ordered, plan_buckets, queues_on_device
from app.weights.staging import StagedPush


class RecordingGroup:
    """Stands in for a `StatelessGroup`: each broadcast fills the receiver's buffer from `source` at once and
    every call is logged, so the order of posts, waits and loads can be read back."""

    def __init__(self, source: list[torch.Tensor] | None = None) -> None:
        self.source, self.log, self.device = source, [], torch.device("cpu")
        self.n = 0

    def broadcast_async(self, flat: torch.Tensor) -> int:
        if self.source is not None:
            flat.copy_(self.source[self.n])
        self.log.append(("post", self.n))
        self.n += 1
        return self.n - 1

    def follow(self, work: int) -> None:
        self.log.append(("follow", work))

    def wait(self, work: int) -> None:
        self.log.append(("wait", work))


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(3, 5, generator=g) for i in range(5)}


def _plan(state: dict[str, torch.Tensor]) -> Any:
    plan = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in state.items()], 2 * 15 * 4, version=1)
    assert len(plan.buckets) == 3
    return plan


def _flats(plan: Any, state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [torch.cat([state[t.name].reshape(-1) for t in b.tensors]) for b in plan.buckets]


def _receive(load: Any) -> tuple[RecordingGroup, list[str], dict[str, torch.Tensor]]:
    state = _state()
    plan = _plan(state)
    group = RecordingGroup(_flats(plan, state))
    got: dict[str, torch.Tensor] = {}

    def record(items: list[tuple[str, torch.Tensor]]) -> None:
        group.log.append(("load", items[0][0]))
        load(items)
        got.update({n: t.clone() for n, t in items})

    record.queues_on_device = queues_on_device(load)  # type: ignore[attr-defined]
    sums, _ = receive_buckets(plan, group, record)  # type: ignore[arg-type]
    assert sums == [checksum(f) for f in _flats(plan, state)]
    assert all(torch.equal(got[n], state[n]) for n in state)
    return group, sums, got


@pytest.mark.parametrize(
    "load, settle",
    [
        # a device-ordered loader may be handed a bucket the host has not seen arrive: only the last is waited
        (device_ordered(lambda items: None), "follow"),
        # any other loader gets a bucket only after the host saw it arrive
        (lambda items: None, "wait"),
    ],
    ids=["device-ordered", "any-other"],
)
def test_the_receiver_posts_the_next_bucket_before_loading_and_waits_on_the_host_as_its_loader_needs(
    load, settle
):
    group, _, _ = _receive(load)
    assert group.log == [
        ("post", 0), (settle, 0),
        ("post", 1), ("load", "w0"), (settle, 1),
        ("post", 2), ("load", "w2"), ("wait", 2),
        ("load", "w4"),
    ]  # fmt: skip


def test_the_sender_follows_each_bucket_and_waits_for_the_last_under_the_deadline():
    state = _state()
    plan = _plan(state)
    group = RecordingGroup()
    stats = send_buckets(plan, lambda names: [state[n] for n in names], group)  # type: ignore[arg-type]
    assert stats.checksums == [checksum(f) for f in _flats(plan, state)]
    # bucket k is followed only once bucket k+1 is posted: two buffers in flight, the host never waits
    assert group.log == [("post", 0), ("post", 1), ("follow", 0), ("post", 2), ("follow", 1), ("wait", 2)]


def test_the_loaders_that_only_queue_copies_say_so():
    assert queues_on_device(SlotLoader({}, {}))
    assert queues_on_device(StagedPush(None, _plan(_state()), torch.device("cpu"), {})._keep)
    assert not queues_on_device(lambda items: None)
