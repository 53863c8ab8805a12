"""The transport seam: a toy transport added from outside app/ (this file and one registry line) carries a
real push through a real gloo group to a receiver process, with tests/test_sync.py's harness."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from app.weights.broadcast import BroadcastTransport
from app.weights.buckets import _checksum_sums, checksum, plan_buckets, walk_buckets
from app.weights.records import Bucket, GroupInfo, PushStats, SyncError
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


class _FailingSender:
    """A transport's sending side that fails at bucket `fail_at` (the walk's contract, without a group)."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at, self.sent, self.finished = fail_at, [], False

    def send(self, bucket: Bucket, tensors: list[torch.Tensor], stats: PushStats) -> torch.Tensor:
        if bucket.index == self.fail_at:
            raise RuntimeError("peer gone")
        self.sent.append(bucket.index)
        return _checksum_sums(torch.cat([t.reshape(-1) for t in tensors]))

    def finish(self, stats: PushStats) -> None:
        self.finished = True


def test_walk_gathers_every_bucket_on_every_rank_and_raises_a_send_failure_after_the_walk():
    state = {f"w{i}": torch.full((4,), float(i)) for i in range(4)}
    plan = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in state.items()], 16, version=3)
    assert len(plan.buckets) == 4
    gathered: list[list[str]] = []

    def gather(names: list[str]) -> list[torch.Tensor]:
        gathered.append(names)
        return [state[n] for n in names]

    sender = _FailingSender(fail_at=1)
    with pytest.raises(SyncError, match="v3 failed in the toy: peer gone"):
        walk_buckets(plan, gather, sender, "toy")
    assert (
        len(gathered) == 4 and sender.sent == [0] and sender.finished
    )  # no send after a failure; finish still runs
    gathered.clear()
    stats = walk_buckets(plan, gather, None, "toy")  # a rank without a sender gathers, sends nothing
    assert len(gathered) == 4 and stats.checksums == [] and stats.buckets == 4
    ok = _FailingSender(fail_at=-1)
    stats = walk_buckets(plan, gather, ok, "toy")
    assert ok.sent == [0, 1, 2, 3] and stats.checksums == [checksum(t) for t in state.values()]


@pytest.mark.parametrize(
    ("name", "bucket_mb", "high_priority"),
    [("broadcast", 64, True), ("pairwise", 64, True), ("ipc", 512, False)],
)
def test_each_transport_walks_with_the_bucket_size_of_its_own_section(name, bucket_mb, high_priority):
    """`sync.broadcast.*` is the broadcast family's (`broadcast`, `pairwise`), `sync.ipc.*` the CUDA-IPC
    transport's: the trainer plans each push with its transport's bucket size."""
    from types import SimpleNamespace

    from app.config import load_config
    from app.sync import TrainerSync

    over = ["sync.broadcast.bucket_mb=64", "sync.ipc.bucket_mb=512", "sync.broadcast.nccl_high_priority=true"]
    cfg = load_config(None, over)
    cls = transport_class(name)
    assert cls.bucket_mb(cfg.sync) == bucket_mb and cls.high_priority(cfg.sync) is high_priority
    ts = TrainerSync.__new__(TrainerSync)  # the push's planning alone: no group, no hub
    ts.cfg, ts.walker, ts.rank, ts.senders, ts._late = cfg, cls(), 0, 1, None
    planned: list[int] = []
    ts._plan = lambda version, nbytes: planned.append(nbytes) or SimpleNamespace(version=version)
    ts._announce = lambda plan, deadline: (0.0, 0.0)
    ts._send = lambda plan: (PushStats(version=plan.version), None)
    ts.push(1)
    assert planned == [bucket_mb * 2**20]
