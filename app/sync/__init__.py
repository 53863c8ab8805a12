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

  Versions only increase, except that a trainer restored from a checkpoint announces its (older) version and
  the replicas roll back to it. Pushes do not overlap: one push is acknowledged (or failed) before the next is
  announced. Under FSDP2 every trainer rank gathers each bucket (a collective), only rank 0 sends.

On each replica a push is: pause generation -> flush (vLLM's pause returns once the engine is quiet; with
`rollout.partial=keep` requests freeze and continue after resume) -> receive every bucket -> load it ->
set the weight version -> resume -> acknowledge (version, checksums).

The package (torch alone unless named otherwise; nothing here imports vLLM or Ray at import time):

    records.py    plans, group epochs, PushStats, hub instructions (Join | Push | Leave | Unknown | Idle),
                  run-control instructions (Abort | Idle), acknowledgements (Ack, Acks with `missing`)
    buckets.py    bucket planning, packing, checksums
    group.py      the stateless process group of one epoch (gloo / NCCL, deadlines, NCCL abort)
    transport.py  the data-plane seam: `WeightTransport` and its registry (`sync.transport`)
    broadcast.py  the bucketed broadcast transport ("broadcast", the default)
    ipc.py        the CUDA-IPC transport ("ipc": trainer and replicas on one GPU; `sync.transport=auto`)
    hub.py        `WeightHub`: membership, epochs, announcements, acknowledgements (an async Ray actor)
    control.py    `RunControl`: clean stop, trainer heartbeat, abort of in-flight generations (a Ray actor)
    actors.py     both as named Ray actors of one run (Ray)
    trainer.py    `TrainerSync`: the trainer ranks' side (Ray, the learner)
    replica.py    `ReplicaSync`: a rollout replica's side (Ray, the engine through app/vllm)
"""

from app.sync.broadcast import BroadcastTransport, receive_buckets, send_buckets
from app.sync.buckets import checksum, iter_named_full, pack_into, plan_buckets, unpack
from app.sync.control import RunControl, control_name
from app.sync.group import _ABORTING as _ABORTING  # NCCL aborts still running (read by the GPU tests)
from app.sync.group import StatelessGroup, free_port, resolve_backend
from app.sync.hub import WeightHub, check_acks, hub_name
from app.sync.ipc import IpcTransport  # registers "ipc" (trainer and replicas on one GPU)
from app.sync.records import (
    Abort,
    Ack,
    Acks,
    Bucket,
    GroupInfo,
    Idle,
    Instruction,
    Join,
    Leave,
    Push,
    PushPlan,
    PushStats,
    SyncError,
    TensorSpec,
    Unknown,
    group_from_json,
    group_to_json,
    plan_from_json,
    plan_to_json,
)
from app.sync.trainer import TrainerSync
from app.sync.transport import (
    TRANSPORTS,
    WeightTransport,
    make_transport,
    register_transport,
    transport_class,
)

__all__ = [
    "TRANSPORTS",
    "Abort",
    "Ack",
    "Acks",
    "BroadcastTransport",
    "Bucket",
    "GroupInfo",
    "Idle",
    "Instruction",
    "IpcTransport",
    "Join",
    "Leave",
    "Push",
    "PushPlan",
    "PushStats",
    "RunControl",
    "StatelessGroup",
    "SyncError",
    "TensorSpec",
    "TrainerSync",
    "Unknown",
    "WeightHub",
    "WeightTransport",
    "check_acks",
    "checksum",
    "control_name",
    "free_port",
    "group_from_json",
    "group_to_json",
    "hub_name",
    "iter_named_full",
    "make_transport",
    "pack_into",
    "plan_buckets",
    "plan_from_json",
    "plan_to_json",
    "receive_buckets",
    "register_transport",
    "resolve_backend",
    "send_buckets",
    "transport_class",
    "unpack",
]
