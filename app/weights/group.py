"""The stateless process group of one weight-group epoch: its own TCPStore, next to any default group.

gloo on CPU, NCCL on GPU. Every operation has a deadline; NCCL broadcasts past theirs abort the communicator
(not the process). See app/sync.py's protocol for why NCCL completion proves nothing about delivery.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from app.weights.records import SyncError

log = logging.getLogger("app.sync")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# how long a member of an announced epoch waits for the epoch's store to listen (the trainer announces the
# epoch a moment before its store listens; refused connections are retried until then)
STORE_LISTEN_S = 20.0


def wait_for_store(host: str, port: int, within_s: float, what: str) -> None:
    """Return once something listens at the weight group's store `host:port`, within `within_s` seconds.

    Past that, the trainer that announced the epoch is gone (killed mid-push, its group restarting) and the
    join fails now. TCPStore's own connect would retry a refused connection for two rounds of the group's
    timeout, minutes in which a vLLM engine core runs nothing else: the joins of the new trainer's epochs
    would queue behind it and fail in turn."""
    deadline = time.monotonic() + within_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, left)):
                return
        except ConnectionRefusedError:
            if left <= 0:
                raise SyncError(
                    f"{what}: nothing listens at the weight group's store {host}:{port} after {within_s:g}s; "
                    "the trainer that announced this epoch is gone (the replica joins its next epoch)"
                ) from None
            time.sleep(min(0.05, max(0.0, left)))
        except OSError as e:
            raise SyncError(
                f"{what}: the weight group's store {host}:{port} cannot be reached ({e}); check that this "
                "node can open TCP connections to the trainer's node"
            ) from e


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
        high_priority: bool = False,
        store: Any = None,
        tag: str = "",
    ) -> None:
        """`store`: the epoch's TCPStore, already connected (several groups of one epoch share it: the
        pairwise transport); else this group connects it (rank 0 hosts it). `tag` names this group among the
        epoch's groups that share the store (its keys are `relay-weights/{epoch}{tag}/...`)."""
        self.rank, self.world, self.backend, self.timeout = rank, world, backend, timedelta(seconds=timeout_s)
        self.device = torch.device(device)
        if store is None and rank != 0:
            wait_for_store(host, port, min(timeout_s, STORE_LISTEN_S), f"epoch {epoch}")
        self.store = (
            store
            if store is not None
            else dist.TCPStore(
                host,
                port,
                world_size=world,
                is_master=rank == 0,
                timeout=self.timeout,
                wait_for_workers=False,
            )
        )
        prefix = dist.PrefixStore(f"relay-weights/{epoch}{tag}", self.store)
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(prefix, rank, world, self.timeout)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            # `broadcast` enforces `timeout_s` itself and aborts the communicator on expiry; the watchdog,
            # which at its own timeout kills the whole process, must only ever come later.
            opts._timeout = self.nccl_timeout = self.timeout * 2 + timedelta(seconds=30)
            # NCCL's stream at high priority: its kernels are scheduled before the pack, checksum and load
            # kernels queued beside them (bench/sync_bandwidth.py --nccl-high-priority measures it)
            opts.is_high_priority_stream = high_priority
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

    def follow(self, work: Any) -> None:
        """Order what this process does next after `work`, without waiting for it where that can be left to the
        device: NCCL makes the current CUDA stream wait for the broadcast's stream (the host goes on queueing
        the next buckets, so NCCL always has the next broadcast posted); gloo waits, under the deadline.

        A followed NCCL work is still unchecked: end a run of them with `wait` on the last one (NCCL runs one
        group's broadcasts in order, so the last one's completion, under the deadline, covers them all)."""
        if self.backend == "nccl":
            work.wait()  # device-side: the current stream waits on NCCL's; the host does not block
        else:
            work.wait(self.timeout)

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
