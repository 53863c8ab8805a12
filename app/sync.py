"""Versioned, bucketed weight push from the trainer to every rollout replica.

Protocol (one trainer, N receivers; a receiver is one vLLM worker process of one replica):

  join   Membership changes only between pushes. When a replica registers (start, autoscaling) or leaves,
         trainer rank 0 opens a new *epoch*: it hosts a TCPStore on a fresh port and announces
         (epoch, address, world, rank of each receiver) through the hub. Every member builds the same
         stateless process group (gloo on CPU, NCCL on GPU) from that store, next to, never inside, the
         trainer's default group, and acknowledges the epoch. A member that does not acknowledge within
         the deadline is dropped and the epoch is formed again without it.
  push   1. Rank 0 announces (version v, bucket plan) through the hub: names, shapes, dtypes and offsets
            of every tensor in every flat bucket of at most `sync.bucket_mb` MiB.
         2. Every trainer rank walks the buckets in the same order and gathers each bucket's full tensors
            (an FSDP2 collective) in lock-step; only rank 0 packs and broadcasts. Rank 0 keeps gathering
            even after a send failed, so the other ranks never wait in a gather rank 0 will not join.
         3. Each receiver receives bucket by bucket, checksums each flat buffer, and loads it into its
            model; at the end it sets its weight version to v (every token it samples afterwards carries v)
            and acknowledges (v, checksums) through the hub.
         4. The push is complete only when every member acknowledged v with checksums equal to the
            trainer's, within `sync.timeout_s`. NCCL's own completion proves nothing (a broadcast to a dead
            peer can "succeed"); a missing or wrong acknowledgement fails the push naming the replica, and
            the next push forms a new epoch.

The data plane (this module's `StatelessGroup`, `send_buckets`, `receive_buckets`) needs torch alone; the
control plane (`WeightHub`) is plain asyncio, run as a Ray actor by the caller. Nothing here imports vLLM
or Ray, so the GPU tier tests this transport with torch only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class SyncError(RuntimeError):
    """A push or a join failed; the message names the replicas and what they did (or did not) do."""


# ---------------------------------------------------------------- records


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int = 0  # element offset inside its bucket

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Bucket:
    index: int
    dtype: str
    numel: int
    tensors: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return self.numel * _dtype(self.dtype).itemsize


@dataclass(frozen=True)
class PushPlan:
    version: int
    buckets: tuple[Bucket, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def names(self) -> list[str]:
        return [t.name for b in self.buckets for t in b.tensors]


@dataclass(frozen=True)
class GroupInfo:
    """What a receiver needs to join epoch `epoch` of the weight group."""

    epoch: int
    host: str
    port: int
    world: int
    backend: str
    timeout_s: float
    ranks: dict[str, int]  # replica id -> first rank of its workers


@dataclass
class PushStats:
    version: int = 0
    nbytes: int = 0
    buckets: int = 0
    gather_s: float = 0.0
    pack_s: float = 0.0
    transfer_s: float = 0.0
    ack_s: float = 0.0
    total_s: float = 0.0
    checksums: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # per-replica acknowledgements


# ---------------------------------------------------------------- bucket planning and checksums


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.replace("torch.", ""))


def plan_buckets(
    specs: Iterable[tuple[str, tuple[int, ...], torch.dtype | str]], bucket_bytes: int, version: int
) -> PushPlan:
    """Pack tensors, in the given order, into flat buckets of one dtype and at most `bucket_bytes` each.

    A tensor larger than `bucket_bytes` gets a bucket of its own. The order is kept so that every trainer
    rank can gather in the same sequence.
    """
    buckets: list[Bucket] = []
    cur: list[TensorSpec] = []
    cur_dtype: str | None = None
    cur_numel = 0

    def close() -> None:
        nonlocal cur, cur_numel
        if cur:
            buckets.append(Bucket(len(buckets), cur_dtype or "float32", cur_numel, tuple(cur)))
        cur, cur_numel = [], 0

    for name, shape, dtype in specs:
        dname = str(dtype).replace("torch.", "")
        spec = TensorSpec(name, tuple(int(s) for s in shape), dname)
        itemsize = _dtype(dname).itemsize
        if cur and (dname != cur_dtype or (cur_numel + spec.numel) * itemsize > bucket_bytes):
            close()
        cur_dtype = dname
        cur.append(TensorSpec(name, spec.shape, dname, cur_numel))
        cur_numel += spec.numel
    close()
    return PushPlan(version, tuple(buckets))


_CK_COLS = 4096
_CK_MIX = 0x9E3779B97F4A7C15
_U64 = 0xFFFFFFFFFFFFFFFF


def checksum(flat: torch.Tensor) -> str:
    """Bit-level, position-sensitive checksum of a flat buffer, computed on its device.

    The buffer's bytes are read in place as int64 words (its last 0-7 bytes as extra small words), laid out
    as rows of 4096 words. Three int64 sums with wrap-around are kept: the plain sum, the sum weighted by row
    and the sum weighted by column (so a moved word changes one of them). Wrap-around addition is
    associative, so CPU and GPU reductions in any order agree bit for bit. Cost: two reads of the buffer
    (row and column sums), a few small kernels and one device sync; no int64 copy of the buffer is made.
    """
    return _ck_format(_checksum_sums(flat).tolist())


def _checksum_sums(flat: torch.Tensor) -> torch.Tensor:
    """`checksum`'s three sums as an int64 tensor on the buffer's device, without a device sync."""
    raw = flat.detach().contiguous().view(-1).view(torch.uint8)
    n8 = raw.numel() // 8
    head = raw[: n8 * 8]
    if head.storage_offset() % 8:  # an int64 view needs 8-byte alignment; the values do not depend on it
        head = head.clone()
    words = head.view(torch.int64)
    rows = n8 // _CK_COLS
    grid = words[: rows * _CK_COLS].view(rows, _CK_COLS)
    row_sums, col_sums = grid.sum(dim=1), grid.sum(dim=0)
    sums = torch.stack(
        [
            col_sums.sum(),
            (row_sums * _ramp(rows, raw.device)).sum(),
            (col_sums * _ramp(_CK_COLS, raw.device)).sum(),
        ]
    )
    if rows * _CK_COLS < n8 or n8 * 8 < raw.numel():  # a tail: words after the last full row, then bytes
        tail = torch.cat([words[rows * _CK_COLS :], raw[n8 * 8 :].to(torch.int64)])
        t = tail.sum()
        sums = sums + torch.stack([t, t * (rows + 1), (tail * _ramp(tail.numel(), raw.device)).sum()])
    return sums


@functools.lru_cache(maxsize=64)
def _ramp(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(1, n + 1, device=device, dtype=torch.int64)


def _ck_format(sums: list[int]) -> str:
    a, b, c = sums
    return f"{a & _U64:016x}{(b + c * _CK_MIX) & _U64:016x}"


def _ck_strings(sums: list[torch.Tensor]) -> list[str]:
    """Format the per-bucket sums of a whole push with one device sync."""
    return [_ck_format(v) for v in torch.stack(sums).tolist()] if sums else []


def unpack(bucket: Bucket, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views of each tensor of `bucket` inside its received flat buffer."""
    return [(t.name, flat[t.offset : t.offset + t.numel].view(t.shape)) for t in bucket.tensors]


def pack_into(bucket: Bucket, tensors: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    for spec, t in zip(bucket.tensors, tensors, strict=True):
        out[spec.offset : spec.offset + spec.numel].copy_(t.reshape(-1), non_blocking=True)
    return out


# ---------------------------------------------------------------- the stateless process group


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def resolve_backend(backend: str, device: torch.device | str) -> str:
    if backend != "auto":
        return backend
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


_ABORTING: list[Any] = []  # NCCL groups whose abort is still running (see _abort_nccl)


def _abort_nccl(pg: Any, wait_s: float) -> None:
    """Abort an NCCL group from a helper thread; wait for it at most `wait_s` seconds.

    ncclCommAbort first raises the abort flag (a stuck kernel leaves at once), then frees its resources in
    step with the other ranks: with a peer that is alive but not taking part, that waits until the peer
    aborts or dies. The caller must never wait on a peer, so the rest finishes in the background.
    """

    def run() -> None:
        with contextlib.suppress(Exception):
            pg.abort()
        _ABORTING.remove(pg)

    _ABORTING.append(pg)
    t = threading.Thread(target=run, name="relay-nccl-abort", daemon=True)
    t.start()
    t.join(wait_s)


class StatelessGroup:
    """A process group built from its own TCPStore, independent of the default group.

    Rank 0 (the trainer) hosts the store. Every operation has a timeout: a dead peer fails gloo at once and a
    silent one after `timeout_s`; for NCCL the caller must not trust completion (see the module docstring).
    NCCL: the join connects every member (or fails after `timeout_s`), and a broadcast still running after
    `timeout_s` aborts the group and raises SyncError; the process lives on and can form a new group.
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world: int,
        backend: str,
        timeout_s: float,
        epoch: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.rank, self.world, self.backend, self.timeout = rank, world, backend, timedelta(seconds=timeout_s)
        self.device = torch.device(device)
        self.store = dist.TCPStore(
            host, port, world_size=world, is_master=rank == 0, timeout=self.timeout, wait_for_workers=False
        )
        prefix = dist.PrefixStore(f"relay-weights/{epoch}", self.store)
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(prefix, rank, world, self.timeout)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            # `broadcast` enforces `timeout_s` itself and aborts the communicator on expiry; the watchdog,
            # which at its own timeout kills the whole process, must only ever come later.
            opts._timeout = self.nccl_timeout = self.timeout * 2 + timedelta(seconds=30)
            self.pg = dist.ProcessGroupNCCL(prefix, rank, world, opts)
            # Connect now, not at the first broadcast (a blocking NCCL init that no deadline can interrupt):
            # first wait, under the timeout, until every member has arrived; a missing one fails the join.
            prefix.set(f"arrived/{rank}", "1")
            prefix.wait([f"arrived/{r}" for r in range(world)], self.timeout)
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self.pg.eager_connect_single_device(torch.device("cuda", index))
            # NCCL connects its transports at the first collective, blocking the CPU until every peer takes
            # part; do that here, while all are present, so a later broadcast never blocks on its launch
            self.barrier()
        else:
            raise ValueError(f"unknown weight-group backend {backend!r}; use gloo or nccl")

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        self.wait(self.broadcast_async(t, src))

    def broadcast_async(self, t: torch.Tensor, src: int = 0) -> Any:
        """Start a broadcast of `t` and return its work; `wait` for it (NCCL runs it on its own stream)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = self.nccl_timeout if self.backend == "nccl" else self.timeout
        return self.pg.broadcast([t], opts)

    def wait(self, work: Any) -> None:
        if self.backend == "nccl":
            self._wait_nccl(work)
        else:
            work.wait(self.timeout)

    def _wait_nccl(self, work: Any) -> None:
        """Wait for an NCCL operation under the group's deadline; on expiry abort the communicator and raise.

        torch's `work.wait(timeout)` sleeps 1 ms between polls (a millisecond per bucket) and times out with
        the watchdog, which then kills the process. Aborting first ends the stuck kernel and keeps the
        process alive: the caller reports the failure and forms a new group.
        """
        deadline = time.monotonic() + self.timeout.total_seconds()
        polls = 0
        while not work.is_completed():
            if time.monotonic() > deadline:
                pg, self.pg = self.pg, None
                _abort_nccl(pg, wait_s=2.0)
                log.warning(
                    "weight group: NCCL broadcast past its %.0fs deadline, group aborted",
                    self.timeout.total_seconds(),
                )
                raise SyncError(
                    f"NCCL broadcast (rank {self.rank} of {self.world}) did not complete within "
                    f"{self.timeout.total_seconds():.0f}s: a peer is dead or not taking part; group aborted"
                )
            polls += 1
            if polls > 1000:
                time.sleep(2e-4)
        work.wait()  # raises the communicator's error, if any; orders the current stream after NCCL's

    def barrier(self) -> None:
        t = torch.zeros(1, device=self.device)
        self.broadcast(t)

    def close(self) -> None:
        if self.backend == "nccl" and self.pg is not None:
            _abort_nccl(self.pg, wait_s=10.0)
        self.pg = None  # type: ignore[assignment]
        self.store = None  # type: ignore[assignment]


# ---------------------------------------------------------------- sender and receiver


def send_buckets(
    plan: PushPlan,
    gather: Callable[[list[str]], list[torch.Tensor]],
    group: StatelessGroup | None,
    device: torch.device | str = "cpu",
) -> PushStats:
    """Walk the plan's buckets on every trainer rank; rank 0 (the one holding `group`) sends.

    `gather(names)` returns the full tensors of those names; on FSDP2 it is a collective, so every rank
    calls it for every bucket in the same order. Ranks without a group discard what they gathered. A send
    failure on rank 0 is raised only after the walk, so the other ranks are never left in a gather.
    """
    stats = PushStats(version=plan.version, nbytes=plan.nbytes, buckets=len(plan.buckets))
    t_start = time.perf_counter()
    error: BaseException | None = None
    sums: list[torch.Tensor] = []
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
            work = group.broadcast_async(flat)
            # checksummed while the bytes are in flight; formatted after the walk (no device sync per bucket)
            sums.append(_checksum_sums(flat))
            group.wait(work)
        except Exception as e:  # keep walking: the other ranks are waiting in the gathers
            error = e
        if flat.is_cuda:
            torch.cuda.synchronize(flat.device)
        stats.transfer_s += time.perf_counter() - t2
    stats.checksums = _ck_strings(sums)
    stats.total_s = time.perf_counter() - t_start
    if error is not None:
        raise SyncError(f"weight push v{plan.version} failed in the broadcast: {error}") from error
    return stats


def receive_buckets(
    plan: PushPlan,
    group: StatelessGroup,
    load: Callable[[list[tuple[str, torch.Tensor]]], None],
    device: torch.device | str = "cpu",
) -> tuple[list[str], dict[str, float]]:
    """Receive every bucket of `plan`, checksum it, and hand its tensors to `load`. Returns checksums, timings.

    Each bucket is checksummed and loaded while the next one is in flight; `load` sees the buckets in order.
    """
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
        work = group.broadcast_async(flat)
        if received is not None:
            finish(*received)
        group.wait(work)
        received = (bucket, flat)
    if received is not None:
        finish(*received)
    timing["transfer_s"] = time.perf_counter() - t_start - timing["load_s"]
    return _ck_strings(sums), timing


def iter_named_full(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for plain tensors and DTensors alike; gathering is a collective for DTensors."""
    for name, t in named:
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        yield name, full.detach()


# ---------------------------------------------------------------- control plane


@dataclass
class _Member:
    replica_id: str
    workers: int
    registered_at: float
    started_at: float = 0.0  # when the replica's constructor began (for rollout/join_s)
    alive: bool = True  # False once it left or was dropped: not part of the next epoch
    leaving: bool = False  # it asked to leave (downscaling); it still finishes a push already announced
    version: int = -1
    epoch: int = -1
    push_epoch: int = -1  # the epoch of its last acknowledged push (a retried push comes in a new epoch)
    admitted_at: float | None = None  # first acknowledged push: from then on it serves rollout traffic
    join_s: float | None = None
    pushes: int = 0
    first_served: dict[str, int] | None = None  # versions when it served its first rollout request
    left_at: float | None = None
    dropped: str | None = None


class WeightHub:
    """Control plane of the weight group: membership, announcements and acknowledgements.

    Run as an async Ray actor (the caller wraps it with `ray.remote`). Replicas long-poll `next_instruction`;
    the trainer calls `open_epoch`, `announce` and `wait_acks`. Every wait takes a deadline.
    """

    def __init__(self) -> None:
        self.members: dict[str, _Member] = {}
        self.group: GroupInfo | None = None
        self.plan: PushPlan | None = None
        self.version = -1  # last version acknowledged by every member
        self.acks: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
        self.changed = asyncio.Condition()
        self.last_push: dict[str, Any] = {}
        self.stop: str | None = None  # a clean stop was requested (signal, `ray job stop`): the reason
        self.abort_seq = 0  # `abort_inflight` calls: replicas end their in-flight generations (checkpoints)
        self.heartbeat: dict[str, Any] = {}  # the trainer's last reported phase (watchdog reports)

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def register(self, replica_id: str, workers: int = 1, started_at: float | None = None) -> int:
        """A replica asks to join; it becomes a member at the next epoch (the next push re-forms the group).

        Returns the version the replica must hold before it may serve: -1 when nothing was pushed yet (the
        run is starting and the trainer's first push comes before any rollout), else the latest version.
        """
        now = time.time()
        self.members[replica_id] = _Member(replica_id, workers, now, started_at or now)
        log.info("replica %s registered with %d worker(s)", replica_id, workers)
        await self._notify()
        return self.current_version()

    def current_version(self) -> int:
        return max(self.version, self.plan.version if self.plan is not None else -1)

    async def leave(self, replica_id: str) -> None:
        """A replica is going away (downscaling): it is left out of the next epoch; a push already announced
        to its epoch is still delivered to it before its loop receives 'leave'."""
        m = self.members.get(replica_id)
        if m is not None and m.alive:
            m.alive, m.leaving, m.left_at = False, True, time.time()
            log.info("replica %s leaves the weight group", replica_id)
        await self._notify()

    async def request_stop(self, reason: str) -> None:
        """Ask the trainer to stop cleanly after the step in progress (it saves and reports as usual)."""
        if self.stop is None:
            self.stop = reason
            log.warning("clean stop requested: %s", reason)

    async def stop_reason(self) -> str | None:
        return self.stop

    async def served(self, replica_id: str, version: int) -> None:
        """A replica reports its first rollout request and the version it served it with."""
        m = self.members.get(replica_id)
        if m is not None and m.first_served is None:
            m.first_served = {"version": version, "hub_version": self.current_version()}

    def membership_changed(self) -> bool:
        if self.group is None:
            return bool(self.alive_ids())
        return set(self.group.ranks) != set(self.alive_ids())

    async def alive_count(self) -> int:
        return len(self.alive_ids())

    def alive_ids(self) -> list[str]:
        return sorted(m.replica_id for m in self.members.values() if m.alive)

    async def open_epoch(self, host: str, port: int, backend: str, timeout_s: float) -> GroupInfo:
        """Assign ranks to the live members and announce a new epoch of the weight group."""
        ranks, nxt = {}, 1
        for rid in self.alive_ids():
            ranks[rid] = nxt
            nxt += self.members[rid].workers
        epoch = (self.group.epoch + 1) if self.group else 0
        self.group = GroupInfo(epoch, host, port, nxt, backend, timeout_s, ranks)
        self.plan = None
        await self._notify()
        return self.group

    async def announce(self, plan: PushPlan) -> None:
        if plan.version < self.version:  # the trainer restored an earlier checkpoint: replicas roll back
            log.warning(
                "version %d announced after %d: rolling the replicas back (trainer restored from a checkpoint)",
                plan.version,
                self.version,
            )
        if plan.version <= self.version:  # (the same version again: a retry, or a restore at this version)
            self.version = plan.version - 1
        self.plan = plan
        self.last_push = {
            "version": plan.version,
            "announced_at": time.time(),
            "epoch": self.group.epoch if self.group else None,
        }
        await self._notify()

    async def abort_inflight(self, timeout_s: float) -> dict[str, Any]:
        """Every live replica ends its in-flight generations now (vLLM's abort pause): each request returns
        what it generated so far, finish reason 'abort', so the rollouter can save the partial rollouts.
        Returns the acknowledgements (missing replicas under '__missing__')."""
        self.abort_seq += 1
        seq = self.abort_seq
        expected = set(self.alive_ids())
        await self._notify()
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.acks.get(("abort", seq), {})
            missing = sorted(
                expected - set(got) - {m.replica_id for m in self.members.values() if not m.alive}
            )
            left = deadline - time.monotonic()
            if not missing or left <= 0:
                break
            async with self.changed:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), timeout=min(left, 1.0))
        out = dict(self.acks.get(("abort", seq), {}))
        out["__missing__"] = {"ids": missing}
        return out

    async def abort_count(self) -> int:
        return self.abort_seq

    async def beat(self, info: dict[str, Any]) -> None:
        """The trainer's rank 0 reports what it is doing (phase, step, since when): read by stall reports."""
        self.heartbeat = {**info, "at": time.time()}

    async def next_instruction(
        self, replica_id: str, epoch: int, version: int, wait_s: float, abort_seen: int = -1
    ) -> dict[str, Any]:
        """Long-poll: what should this replica do next? {'kind': 'join'|'push'|'abort'|'idle'|'unknown', ...}."""
        deadline = time.monotonic() + wait_s
        while True:
            m = self.members.get(replica_id)
            g = self.group
            if m is not None and m.alive and 0 <= abort_seen < self.abort_seq:
                return {"kind": "abort", "seq": self.abort_seq}
            if m is not None and m.leaving:
                pending = (
                    g is not None
                    and g.epoch == epoch
                    and replica_id in g.ranks
                    and self.plan is not None
                    and self.plan.version > version
                )
                return {"kind": "push", "plan": self.plan} if pending else {"kind": "leave"}
            if m is None or not m.alive:
                return {"kind": "unknown"}
            if g is not None and replica_id in g.ranks and g.epoch != epoch:
                return {"kind": "join", "group": g, "rank": g.ranks[replica_id]}
            if (
                g is not None
                and g.epoch == epoch
                and replica_id in g.ranks
                and self.plan is not None
                # another version (newer, or older after the trainer restored a checkpoint), or the same
                # version retried in a new epoch (the replica may have received it before a broadcast failed
                # elsewhere: every member must take part in the retry)
                and (self.plan.version != version or m.push_epoch != g.epoch)
            ):
                return {"kind": "push", "plan": self.plan}
            left = deadline - time.monotonic()
            if left <= 0:
                return {"kind": "idle"}
            async with self.changed:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), timeout=left)

    async def ack(self, replica_id: str, kind: str, key: int, ok: bool, detail: dict[str, Any]) -> None:
        entry = {"ok": ok, **detail}
        m = self.members.get(replica_id)
        if m is not None and ok:
            if kind == "join":
                m.epoch = key
            elif kind == "push":
                m.version = key
                m.push_epoch = self.group.epoch if self.group else -1
                m.pushes += 1
                if m.admitted_at is None:  # its first verified weights: admitted to serve
                    m.admitted_at = time.time()
                    m.join_s = m.admitted_at - m.started_at
                    entry["join_s"] = m.join_s
        self.acks.setdefault((kind, key), {})[replica_id] = entry
        await self._notify()

    async def wait_acks(self, kind: str, key: int, timeout_s: float) -> dict[str, dict[str, Any]]:
        """Wait until every member of the current epoch acknowledged (kind, key), or the deadline.

        Returns the acknowledgements; members that did not answer are listed under the key '__missing__'.
        """
        expected = set(self.group.ranks) if self.group else set()
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.acks.get((kind, key), {})
            missing = sorted(expected - set(got))
            if not missing:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            async with self.changed:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), timeout=min(left, 1.0))
        out = dict(self.acks.get((kind, key), {}))
        out["__missing__"] = {"ids": missing}  # type: ignore[dict-item]
        if kind == "push" and not missing and all(a.get("ok") for k, a in out.items() if k != "__missing__"):
            self.version = max(self.version, key)
        return out

    async def drop(self, replica_ids: list[str]) -> None:
        """Remove members that failed a join or a push; they must register again to rejoin."""
        for rid in replica_ids:
            m = self.members.get(rid)
            if m is not None and m.alive:
                m.alive, m.dropped = False, "failed a join or push"
                log.warning("replica %s dropped from the weight group", rid)
        await self._notify()

    async def status(self) -> dict[str, Any]:
        """Version, epoch and every replica ever seen: liveness, version, admission and leave times."""
        return {
            "version": self.version,
            "epoch": self.group.epoch if self.group else None,
            "group": sorted(self.group.ranks) if self.group else [],
            "members": {rid: asdict(m) for rid, m in self.members.items()},
            "membership_changed": self.membership_changed(),
            "stop": self.stop,
            "last_push": self.last_push,
            "trainer": self.heartbeat,
        }


def check_acks(
    acks: dict[str, dict[str, Any]],
    kind: str,
    key: int,
    expected_checksums: list[str] | None,
    timeout_s: float,
) -> None:
    """Raise SyncError naming every replica that did not acknowledge, failed, or loaded other bytes."""
    problems = []
    for rid in acks.get("__missing__", {}).get("ids", []):
        problems.append(
            f"replica {rid} did not acknowledge {kind} {key} within {timeout_s:.0f}s (dead or stuck)"
        )
    for rid, a in acks.items():
        if rid == "__missing__":
            continue
        if not a.get("ok"):
            problems.append(f"replica {rid} failed {kind} {key}: {a.get('error', 'unknown error')}")
        elif expected_checksums is not None and a.get("checksums") != expected_checksums:
            problems.append(f"replica {rid} loaded different bytes for version {key} (checksum mismatch)")
    if problems:
        raise SyncError("; ".join(problems))
