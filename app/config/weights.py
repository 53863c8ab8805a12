"""`sync.*`: the weight push from the trainer to the replicas (buckets, transport, deadline, checksums)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from app.config.base import _TIMEOUT, Backend, Range, _Section, rng


@dataclass
class SyncConfig(_Section):
    bucket_mb: float = 256.0
    """Weights are packed into flat buckets of at most this many MiB per broadcast."""
    ipc_bucket_mb: float = 1024.0
    """Bucket size of the CUDA-IPC transport (its staging buffer lives on the trainer's GPU while a push
    walks): fewer buckets, fewer control round trips (a 1.5B push: 3 buckets, 46 ms; 12 of 256 MiB, 70 ms)."""
    timeout_s: float = 60.0
    """Deadline of one push: transfer, load and every replica's acknowledgement."""
    backend: Backend = "auto"
    """Process-group backend of the weight group: gloo on CPU, nccl on GPU."""
    transport: str = "auto"
    """Weight transport (app/weights/transport.py registry): `auto` (`ipc` when trainer and replicas share one
    GPU, `pairwise` when replicas share a GPU of their own, else `broadcast`), `broadcast` (one broadcast per
    bucket), `pairwise` (one broadcast per bucket and receiver, each over its own two-rank group: NCCL holds
    one rank of a group on a GPU), `ipc` (CUDA IPC handles, trainer and replicas on the same GPU), or a
    `pkg.module:Name` whose module registers or defines it (imported by the trainer and every vLLM worker)."""
    verify: bool = True
    """Compare every replica's checksum of what it loaded with the trainer's."""
    staged_receive: bool = False
    """Replicas receive each push while they generate, into staging buffers (one more copy of the pushed
    weights in each vLLM worker's memory: leave room for it with a lower `rollout.gpu_memory_utilization`), and
    pause generation only to copy them into the model (app/weights/staging.py). false: generation is paused for
    the whole transfer and load."""

    nccl_high_priority: bool = False
    """NCCL: run the weight group's broadcasts on a high-priority CUDA stream, so the pack, checksum and load
    kernels beside them do not slow them down (bench/sync_bandwidth.py --nccl-high-priority: 12-15% off the
    data plane at 3B on two H200s, mixed at 1.5B; not yet measured inside the loop)."""

    _RANGES: ClassVar[dict[str, Range]] = {
        "bucket_mb": rng("> 0"),
        "ipc_bucket_mb": rng("> 0"),
        "timeout_s": _TIMEOUT,
    }
