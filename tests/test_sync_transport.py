"""The transport seam: a toy transport added from outside app/ (this file and one registry line) carries a
real push through a real gloo group to a receiver process, with tests/test_sync.py's harness."""

from __future__ import annotations

from typing import Any

import torch

from app.weights.broadcast import BroadcastTransport
from app.weights.buckets import checksum
from app.weights.records import GroupInfo
from app.weights.transport import TRANSPORTS, register_transport, transport_class
from tests.test_sync import _push

CHUNKS = 3
NAME = "tests.test_sync_transport:chunked"  # how a config names it: `sync.transport=<NAME>`


@register_transport("chunked")
class ChunkedTransport(BroadcastTransport):
    """Each bucket travels as three broadcasts of a third of it; both ends count what they moved."""

    def __init__(self) -> None:
        super().__init__()
        self.stats = {"chunks": 0, "epoch": -1}

    def join(self, info: GroupInfo, rank: int, device: Any) -> None:
        super().join(info, rank, device)
        self.stats["epoch"] = info.epoch

    def start(self, flat: torch.Tensor) -> list[Any]:
        works = [self.group.broadcast_async(c) for c in flat.chunk(CHUNKS)]
        self.stats["chunks"] += len(works)
        return works


def test_name_resolves_through_the_registry_in_a_fresh_process():
    assert TRANSPORTS["chunked"] is ChunkedTransport
    assert transport_class(NAME) is ChunkedTransport  # what a vLLM worker resolves from GroupInfo.transport


def test_push_through_a_toy_transport_is_bit_exact():
    out: dict[str, Any] = {}
    stats, state, got, _ = _push("ok", transport=NAME, sender_out=out)
    assert got is not None, f"the push failed: {stats}"
    # the receiver process built the toy transport from its name, and both ends moved every bucket in chunks
    assert got["transport"] == "ChunkedTransport"
    assert got["transport_stats"]["chunks"] == stats.buckets * CHUNKS > CHUNKS
    assert out["sender"].stats["chunks"] == stats.buckets * CHUNKS
    # and what arrived is exactly what was sent: per bucket (what a replica acknowledges) and per tensor
    assert got["version"] == 7 and got["checksums"] == stats.checksums
    assert got["per_tensor"] == {n: checksum(t) for n, t in state.items()}
