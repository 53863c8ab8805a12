"""The bucketed broadcast transport: each flat bucket is one broadcast from rank 0 over a `StatelessGroup`.

Rank 0 checksums a bucket while it is in flight; receivers checksum and load bucket k while bucket k+1 is in
flight. `send_buckets`/`receive_buckets` are the walk; `start` (one broadcast per bucket here) is the only part a
variant of this transport needs to change.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from app.weights.buckets import _checksum_sums, _ck_strings, _dtype, pack_into, unpack
from app.weights.group import StatelessGroup
from app.weights.records import Bucket, GroupInfo, PushPlan, PushStats, SyncError
from app.weights.transport import Gather, Load, register_transport

Start = Callable[[torch.Tensor], list[Any]]


def _broadcast_one(group: StatelessGroup | None) -> Start:
    return lambda flat: [group.broadcast_async(flat)]  # type: ignore[union-attr]


def send_buckets(
    plan: PushPlan,
    gather: Gather,
    group: StatelessGroup | None,
    device: torch.device | str = "cpu",
    start: Start | None = None,
) -> PushStats:
    """Walk the plan's buckets on every trainer rank; rank 0 (the one holding `group`) sends.

    `gather(names)` returns the full tensors of those names; on FSDP2 it is a collective, so every rank
    calls it for every bucket in the same order. Ranks without a group discard what they gathered. A send
    failure on rank 0 is raised only after the walk, so the other ranks are never left in a gather.
    `start(flat)` starts sending one packed bucket and returns the works to wait for (default: one broadcast).

    Double-buffered: bucket k+1 is gathered, packed and checksummed while bucket k is in flight; at most two
    buckets are staged at once (the wait for bucket k comes after bucket k+1 started).
    """
    stats = PushStats(version=plan.version, nbytes=plan.nbytes, buckets=len(plan.buckets))
    start = start or _broadcast_one(group)
    t_start = time.perf_counter()
    error: BaseException | None = None
    sums: list[torch.Tensor] = []
    inflight: tuple[torch.Tensor, list[Any]] | None = None  # the bucket on the wire: its buffer and works

    def settle() -> None:
        nonlocal inflight, error
        if inflight is None:
            return
        t = time.perf_counter()
        try:
            for work in inflight[1]:
                group.wait(work)  # type: ignore[union-attr]
        except Exception as e:  # keep walking: the other ranks are waiting in the gathers
            error = error or e
        inflight = None
        stats.transfer_s += time.perf_counter() - t

    for bucket in plan.buckets:
        t0 = time.perf_counter()
        tensors = gather([t.name for t in bucket.tensors])
        t1 = time.perf_counter()
        stats.gather_s += t1 - t0
        if group is None or error is not None:
            continue
        flat = torch.empty(bucket.numel, dtype=_dtype(bucket.dtype), device=device)
        pack_into(bucket, tensors, flat)
        t2 = time.perf_counter()
        stats.pack_s += t2 - t1
        try:
            works = start(flat)
        except Exception as e:
            error = e
            works = []
        # checksummed while the bytes are in flight; formatted after the walk (no device sync per bucket)
        sums.append(_checksum_sums(flat))
        stats.transfer_s += time.perf_counter() - t2
        settle()  # the previous bucket: it overlapped this one's gather, pack and checksum
        inflight = (flat, works)
    settle()
    if group is not None and group.device.type == "cuda":
        torch.cuda.synchronize(group.device)
    stats.checksums = _ck_strings(sums) if sums else []
    stats.total_s = time.perf_counter() - t_start
    if error is not None:
        raise SyncError(f"weight push v{plan.version} failed in the broadcast: {error}") from error
    return stats


def receive_buckets(
    plan: PushPlan,
    group: StatelessGroup,
    load: Load,
    device: torch.device | str = "cpu",
    start: Start | None = None,
) -> tuple[list[str], dict[str, float]]:
    """Receive every bucket of `plan`, checksum it, and hand its tensors to `load`. Returns checksums, timings.

    Each bucket is checksummed and loaded while the next one is in flight; `load` sees the buckets in order.
    `start(flat)` starts receiving into one bucket's buffer and returns the works to wait for; it must
    mirror the sender's.
    """
    start = start or _broadcast_one(group)
    sums: list[torch.Tensor] = []
    timing = {"transfer_s": 0.0, "load_s": 0.0}
    t_start = time.perf_counter()
    received: tuple[Bucket, torch.Tensor] | None = None

    def finish(bucket: Bucket, flat: torch.Tensor) -> None:
        t1 = time.perf_counter()
        sums.append(_checksum_sums(flat))  # formatted after the walk: no device sync per bucket
        load(unpack(bucket, flat))
        timing["load_s"] += time.perf_counter() - t1

    for bucket in plan.buckets:
        flat = torch.empty(bucket.numel, dtype=_dtype(bucket.dtype), device=device)
        works = start(flat)
        if received is not None:
            finish(*received)
        for work in works:
            group.wait(work)
        received = (bucket, flat)
    if received is not None:
        finish(*received)
    timing["transfer_s"] = time.perf_counter() - t_start - timing["load_s"]
    return _ck_strings(sums), timing


@register_transport("broadcast")
class BroadcastTransport:
    """Today's transport: a `StatelessGroup` per epoch (gloo or NCCL, `GroupInfo.backend`), one broadcast
    per bucket. Subclasses change how a bucket travels by overriding `start` on both ends."""

    bucket_setting = "bucket_mb"  # the sync config key of this transport's bucket size

    def __init__(self) -> None:
        self.group: StatelessGroup | None = None

    def start(self, flat: torch.Tensor) -> list[Any]:
        """Start moving one bucket's flat buffer (rank 0 sends it, receivers fill it); return the works."""
        return [self.group.broadcast_async(flat)]  # type: ignore[union-attr]

    def open(self, info: GroupInfo, device: torch.device | str) -> None:
        self._connect(info, 0, device)

    def join(self, info: GroupInfo, rank: int, device: torch.device | str) -> None:
        self._connect(info, rank, device)

    def _connect(self, info: GroupInfo, rank: int, device: torch.device | str) -> None:
        self.close()
        self.group = StatelessGroup(
            info.host, info.port, rank, info.world, info.backend, info.timeout_s, info.epoch, device
        )

    def send(self, plan: PushPlan, gather: Gather, device: torch.device | str) -> PushStats:
        return send_buckets(plan, gather, self.group, device, start=self.start if self.group else None)

    def receive(
        self, plan: PushPlan, load: Load, device: torch.device | str
    ) -> tuple[list[str], dict[str, float]]:
        if self.group is None:
            raise SyncError(
                f"receive of v{plan.version} before a join: this worker is not in the weight group"
            )
        return receive_buckets(plan, self.group, load, device, start=self.start)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
