"""The CUDA-IPC transport: trainer and replicas on one GPU, where NCCL cannot put two ranks on one device.

Rank 0 packs each bucket into a staging buffer on its GPU and hands the receivers a CUDA IPC handle of that
buffer (torch's `reduce_tensor`: the handle, the producer's ref counter and a CUDA event ordering the pack
before every read). Each receiver (a vLLM worker on the same GPU) opens the handle once per push, checksums
the bucket and loads it straight out of the trainer's memory into its parameters, and reports that done. The
trainer has two staging buffers: while the receivers copy bucket i out of one, it gathers bucket i+1 (a
collective over its ranks) and packs it into the other, and meets their copy-done signal of bucket i only then
(`_IpcSender`). (An earlier version had the receivers copy each bucket out first, so the trainer could pack the
next one during the load: that copy cost more than the overlap saved.) The handles and descriptions travel
through a gloo `StatelessGroup` of the same epoch (the one-byte-per-bucket control traffic of this transport);
the bytes never leave the GPU.

Versions, acknowledgements and checksums are the hub's, as for every transport. The receivers close their
mappings at the end of each push, before acknowledging; the trainer frees its staging buffers when the walk
ends (torch keeps its memory alive until every receiver's mapping is closed).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from app.weights.broadcast import BroadcastTransport
from app.weights.buckets import _checksum_sums, _ck_strings, _dtype, load_bucket, pack_into, walk_buckets
from app.weights.group import StatelessGroup
from app.weights.records import Bucket, GroupInfo, PushPlan, PushStats, SyncError
from app.weights.transport import Gather, Load, register_transport

if TYPE_CHECKING:
    from app.config.weights import SyncConfig

_META_BYTES = 4096  # one pickled IPC description (about 300 bytes) per bucket
_UUID_BYTES = 16


def _gpu_uuid(device: torch.device) -> torch.Tensor:
    """The GPU's UUID as 16 bytes (a CPU tensor for the gloo group): both ends must be on the same GPU."""
    raw = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    data = raw.bytes if hasattr(raw, "bytes") else str(raw).encode()[:_UUID_BYTES]
    out = torch.zeros(_UUID_BYTES, dtype=torch.uint8)
    out[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    return out


@contextlib.contextmanager
def plain_segments() -> Iterator[None]:
    """CUDA allocations made inside are ordinary `cudaMalloc` segments even where the process runs with
    expandable segments (train.cuda_alloc_conf): an IPC handle of an expandable segment makes its peer fetch
    a file descriptor from this process (pidfd_getfd, which ptrace rules can refuse), an ordinary one not.
    (torch's allocator setting is private API: this is its one use.)"""
    conf = ",".join(os.environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None or "expandable_segments:true" not in conf.lower().replace(" ", ""):
        yield
        return
    setter("expandable_segments:False")
    try:
        yield
    finally:
        setter("expandable_segments:True")


def source_on_same_gpu(uuids: list[torch.Tensor], rank: int, senders: int) -> int | None:
    """The sender (ranks 0..senders-1) on the same GPU as `rank` (by GPU UUID, `uuids` in rank order): a sender
    itself, or None where no sender shares the GPU."""
    if rank < senders:
        return rank
    return next((s for s in range(senders) if torch.equal(uuids[s], uuids[rank])), None)


def export_handle(t: torch.Tensor) -> bytes:
    """A picklable description of CUDA tensor `t` (its IPC handle) that `open_handle` rebuilds elsewhere."""
    from torch.multiprocessing.reductions import reduce_tensor

    _rebuild, args = reduce_tensor(t)
    return pickle.dumps(args)


def open_handle(meta: bytes, device: torch.device) -> torch.Tensor:
    """Map the tensor described by `export_handle` into this process (on `device`: the producer's index
    in its own process may differ from ours, the GPU is the same)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(pickle.loads(meta))
    args[6] = device.index if device.index is not None else torch.cuda.current_device()
    return rebuild_cuda_tensor(*args)


@register_transport("ipc")
class IpcTransport(BroadcastTransport):
    """CUDA IPC buckets on one GPU; a gloo group of the epoch carries the handles and the copy-done signals."""

    every_rank_sends = True  # each trainer rank serves the replicas on its own GPU

    @staticmethod
    def bucket_mb(sync: SyncConfig) -> float:
        """`sync.ipc.bucket_mb`: its own bucket size (the stage is on the GPU; each bucket costs round trips)."""
        return float(sync.ipc.bucket_mb)

    @staticmethod
    def high_priority(sync: SyncConfig) -> bool:
        """False: its group is gloo, for the control traffic only (the bytes never travel over NCCL)."""
        return False

    def __init__(self) -> None:
        super().__init__()
        self.device = torch.device("cpu")
        self.senders, self.source = 1, None  # trainer ranks in the group; a receiver's sender

    def _connect(self, info: GroupInfo, rank: int, device: torch.device | str) -> None:
        self.close()
        self.device = torch.device(device)
        self.senders = info.senders
        self._check_device(self.device)
        # the control traffic only: NCCL cannot put two ranks on one device
        self.group = StatelessGroup(
            info.host, info.port, rank, info.world, "gloo", info.timeout_s, info.epoch, "cpu"
        )
        self._check_same_gpu(rank)

    @staticmethod
    def _check_device(device: torch.device) -> None:
        if device.type != "cuda":
            raise SyncError(
                f"sync.transport=ipc needs the trainer and the replicas on one CUDA GPU; this end is on "
                f"{device}: use sync.transport=broadcast"
            )

    def _allgather(self, mine: torch.Tensor) -> list[torch.Tensor]:
        """Every member's `mine` (a CPU tensor of one shape), in rank order."""
        out = [torch.empty_like(mine) for _ in range(self.group.world)]  # type: ignore[union-attr]
        self.group.wait(self.group.pg.allgather([out], [mine]))  # type: ignore[union-attr]
        return out

    def _check_same_gpu(self, rank: int) -> None:
        """Pair each receiver with the sender on its GPU (by GPU UUID): `self.source` is that sender's rank."""
        uuids = self._allgather(_gpu_uuid(self.device))
        self.source = source_on_same_gpu(uuids, rank, self.senders)
        if self.source is None:
            self.close()
            raise SyncError(
                "sync.transport=ipc: this replica's GPU holds no trainer rank (CUDA IPC maps memory of one "
                "GPU): put a trainer rank beside every replica (resources.colocate=true, or one GPU for both), "
                "or use sync.transport=broadcast (sync.transport=auto picks ipc only where they share GPUs)"
            )

    def _signal(self, ok: bool) -> bool:
        """A bucket's copy is done on every receiver (all-reduce of failures; rank 0 adds none)."""
        flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
        work = self.group.pg.allreduce([flag])  # type: ignore[union-attr]
        self.group.wait(work)  # type: ignore[union-attr]
        return int(flag.item()) == 0

    def _metas(self, meta: bytes = b"") -> list[bytes]:
        """Every sender's description of its bucket (a receiver gives none): an empty one says that sender
        failed and no bucket follows from any."""
        buf = torch.zeros(_META_BYTES, dtype=torch.uint8)
        if meta:
            if len(meta) + 4 > _META_BYTES:
                raise SyncError(f"IPC description of {len(meta)} bytes exceeds {_META_BYTES}")
            buf[:4] = torch.tensor(list(len(meta).to_bytes(4, "little")), dtype=torch.uint8)
            buf[4 : 4 + len(meta)] = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
        out = []
        for got in self._allgather(buf)[: self.senders]:
            n = int.from_bytes(bytes(got[:4].tolist()), "little")
            out.append(bytes(got[4 : 4 + n].numpy().tobytes()))
        return out

    def send(self, plan: PushPlan, gather: Gather, device: torch.device | str) -> PushStats:
        """Walk every bucket (gathers are collectives on every rank); rank 0 (with a group) exports them."""
        sender = None
        if self.group is not None and plan.buckets:
            most = max(b.numel * _dtype(b.dtype).itemsize for b in plan.buckets)
            n = 2 if len(plan.buckets) > 1 else 1  # double-buffered (see _IpcSender)
            with plain_segments():
                stages = [torch.empty(most, dtype=torch.uint8, device=device) for _ in range(n)]
            sender = _IpcSender(self, stages)
        return walk_buckets(plan, gather, sender, "IPC transport")

    def _tell_failed(self) -> None:
        """Best effort: an empty description tells the receivers that no more buckets come."""
        with contextlib.suppress(Exception):  # the group itself is broken: the receivers fail on their own
            self._metas(b"")

    def receive(
        self, plan: PushPlan, load: Load, device: torch.device | str
    ) -> tuple[list[str], dict[str, float]]:
        self._joined(plan)
        dev = torch.device(device)
        sums: list[torch.Tensor] = []
        timing = {"transfer_s": 0.0, "load_s": 0.0}
        opened: dict[bytes, torch.Tensor] = {}  # handle -> mapping, closed when this push ends
        try:
            for bucket in plan.buckets:
                t0 = time.perf_counter()
                metas = self._metas()
                if not all(metas):
                    raise SyncError(f"the trainer failed before bucket {bucket.index} of v{plan.version}")
                meta = metas[self.source]
                t1 = time.perf_counter()
                err = None
                try:  # straight from the trainer's staging buffer: no copy of our own
                    flat = self._mapped(meta, opened, dev)
                    sums.append(_checksum_sums(flat))
                    load_bucket(load, bucket, flat)
                    if flat.is_cuda:  # read before the trainer may overwrite the stage
                        torch.cuda.current_stream(dev).synchronize()
                except Exception as e:  # still signal: every end must learn of it at the same bucket
                    err = e
                t2 = time.perf_counter()
                if not self._signal(err is None):
                    raise SyncError(
                        f"bucket {bucket.index} of v{plan.version} failed: {err or 'another receiver'}"
                    )
                timing["transfer_s"] += (t1 - t0) + (time.perf_counter() - t2)
                timing["load_s"] += t2 - t1
        finally:
            opened.clear()
        return _ck_strings(sums), timing

    def _mapped(self, meta: bytes, opened: dict[bytes, torch.Tensor], dev: torch.device) -> torch.Tensor:
        """This bucket's bytes in the trainer's staging buffer, mapped into this process."""
        src = open_handle(meta, dev)
        # keep the first mapping of the staging buffer all push long: torch's cache then maps it only once
        opened.setdefault(pickle.loads(meta)[7], src)
        return src


class _IpcSender:
    """A sending rank's end of the IPC walk, double-buffered: bucket i is packed into one of two staging
    buffers and its handle handed to the receivers; the sender does not wait for their copy-done signal of
    bucket i until it has gathered and packed bucket i+1 into the other buffer, so the trainer's gather (a
    collective over its ranks) overlaps the replicas' copies. A buffer is reused (bucket i+2) only after the
    signal of the bucket it held. Every end still meets the gloo collectives in one order: description i,
    signal i, description i+1, ..."""

    def __init__(self, transport: IpcTransport, stages: list[torch.Tensor]) -> None:
        self.transport = transport
        self.stages: list[torch.Tensor] = stages  # one, or two where the push has several buckets
        self.sent = 0
        self.pending: int | None = None  # the bucket whose copy-done signal is still to be met

    def send(self, bucket: Bucket, tensors: list[torch.Tensor], stats: PushStats) -> torch.Tensor:
        t1 = time.perf_counter()
        try:
            nbytes = bucket.numel * _dtype(bucket.dtype).itemsize
            stage = self.stages[self.sent % len(self.stages)]
            flat = stage[:nbytes].view(_dtype(bucket.dtype))
            pack_into(bucket, tensors, flat)
            sums = _checksum_sums(flat)
            # packed before any receiver reads (torch's IPC event orders only a handle's first opening)
            if flat.is_cuda:
                torch.cuda.current_stream(flat.device).synchronize()
            meta = export_handle(flat)
        except Exception:
            with contextlib.suppress(Exception):  # the receivers are in the previous bucket's signal
                self._settle(stats)
            self.transport._tell_failed()  # the receivers wait for a description: no more buckets come
            raise
        t2 = time.perf_counter()
        stats.pack_s += t2 - t1
        self._settle(stats)  # the previous bucket's copies, overlapped with this bucket's gather and pack
        # a failure here means the group broke (a receiver died): every end fails on its own
        if not all(self.transport._metas(meta)):
            raise SyncError(f"another trainer rank failed before bucket {bucket.index}")
        self.pending, self.sent = bucket.index, self.sent + 1
        stats.transfer_s += time.perf_counter() - t2
        return sums

    def _settle(self, stats: PushStats) -> None:
        """Meet the copy-done signal of the bucket handed out last (if any); raise if a receiver failed."""
        if self.pending is None:
            return
        index, self.pending = self.pending, None
        t0 = time.perf_counter()
        ok = self.transport._signal(True)
        stats.transfer_s += time.perf_counter() - t0
        if not ok:
            raise SyncError(f"a receiver failed to copy bucket {index}")

    def finish(self, stats: PushStats) -> None:
        try:
            self._settle(stats)
        finally:
            # receivers closed their mappings with their last copy; torch frees the buffers when they did
            self.stages = []
