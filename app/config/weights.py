"""`sync.*`: the weight push from the trainer to the replicas (transport, deadline, checksums), with one
sub-section per transport family for the keys only it reads: `sync.broadcast.*` (the `broadcast` and
`pairwise` transports) and `sync.ipc.*` (the CUDA-IPC transport)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from app.config.base import _TIMEOUT, Backend, Range, _Section, rng


@dataclass
class BroadcastSyncConfig(_Section):
    """`sync.broadcast.*`: the transports that broadcast each bucket over a process group (`broadcast`,
    `pairwise`; app/weights/broadcast.py)."""

    bucket_mb: float = 256.0
    """Weights are packed into flat buckets of at most this many MiB per broadcast."""
    nccl_high_priority: bool = False
    """NCCL: run the weight group's broadcasts on a high-priority CUDA stream, so the pack, checksum and load
    kernels beside them do not slow them down (bench/sync_bandwidth.py --nccl-high-priority: 12-15% off the
    data plane at 3B on two H200s, mixed at 1.5B; not yet measured inside the loop)."""

    _RANGES: ClassVar[dict[str, Range]] = {"bucket_mb": rng("> 0")}


@dataclass
class IpcSyncConfig(_Section):
    """`sync.ipc.*`: the CUDA-IPC transport (`ipc`: trainer and replicas on one GPU; app/weights/ipc.py)."""

    bucket_mb: float = 1024.0
    """Bucket size of the CUDA-IPC transport (its staging buffer lives on the trainer's GPU while a push
    walks): fewer buckets, fewer control round trips (a 1.5B push: 3 buckets, 46 ms; 12 of 256 MiB, 70 ms)."""

    _RANGES: ClassVar[dict[str, Range]] = {"bucket_mb": rng("> 0")}


@dataclass
class SyncConfig(_Section):
    timeout_s: float = 60.0
    """Deadline of one push: transfer, load and every replica's acknowledgement."""
    backend: Backend = "auto"
    """Process-group backend of the weight group: gloo on CPU, nccl on GPU."""
    transport: str = "auto"
    """Weight transport (app/weights/transport.py registry): `auto` (`ipc` when trainer and replicas share one
    GPU, `pairwise` when replicas share a GPU of their own, else `broadcast`), `broadcast` (one broadcast per
    bucket), `pairwise` (one broadcast per bucket and receiver, each over its own two-rank group: NCCL holds
    one rank of a group on a GPU), `ipc` (CUDA IPC handles, trainer and replicas on the same GPU), or a
    `pkg.module:Name` whose module registers or defines it (imported by the trainer and every vLLM worker).
    Each transport reads its own settings: `sync.broadcast.*` or `sync.ipc.*`."""
    verify: bool = True
    """Compare every replica's checksum of what it loaded with the trainer's."""
    staged_receive: bool = False
    """Replicas receive each push while they generate, into staging buffers (one more copy of the pushed
    weights in each vLLM worker's memory: leave room for it with a lower `rollout.gpu_memory_utilization`), and
    pause generation only to copy them into the model (app/weights/staging.py). false: generation is paused for
    the whole transfer and load."""
    broadcast: BroadcastSyncConfig = field(default_factory=BroadcastSyncConfig)
    """The `broadcast` and `pairwise` transports' settings (`sync.broadcast.*`)."""
    ipc: IpcSyncConfig = field(default_factory=IpcSyncConfig)
    """The `ipc` transport's settings (`sync.ipc.*`)."""

    _RANGES: ClassVar[dict[str, Range]] = {"timeout_s": _TIMEOUT}

    def check(self, prefix: str) -> None:
        """This section's values, then each transport's."""
        super().check(prefix)
        self.broadcast.check(f"{prefix}broadcast.")
        self.ipc.check(f"{prefix}ipc.")
