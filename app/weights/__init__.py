"""What the weight push (app/sync.py, the protocol and both its ends) stands on. Torch alone unless named
otherwise; nothing here imports vLLM or Ray at import time.

    records.py    plans, group epochs, PushStats, hub instructions (Join | Push | Leave | Unknown | Idle),
                  run-control instructions (Abort | Idle), acknowledgements (Ack, Acks with `missing`)
    buckets.py    bucket planning, packing, checksums; `walk_buckets`, the trainer's walk every transport sends on
    group.py      the stateless process group of one epoch (gloo / NCCL, deadlines, NCCL abort)
    transport.py  the data-plane seam: `WeightTransport` and its registry (`sync.transport`)
    broadcast.py  the bucketed broadcast transport ("broadcast", the default)
    ipc.py        the CUDA-IPC transport ("ipc": trainer and replicas on one GPU; `sync.transport=auto`)
    pairwise.py   the broadcast over one two-rank group per receiver ("pairwise": replicas sharing a GPU)
    hub.py        `WeightHub`: membership, epochs, announcements, acknowledgements (an async Ray actor)
    ack_board.py  acknowledgements through the epoch's own TCPStore, each vLLM worker's as soon as it loaded
                  (`answered`), made into each replica's (`replica_acks`): the trainer's short way back
    staging.py    the staged receive: workers receive while the engine generates, then copy under the pause
    epoch.py      `TrainerEpoch`: the trainer's end of the join (forming an epoch with the hub) and where the
                  current epoch's push acknowledgements come from
    loaders.py    how a replica loads a push (`PausedLoad`, `StagedLoad`), the drain of `partial=off`
                  (`GenerationGate`); the engine through app/vllm/engine.py
    adapters.py   `ReplicaAdapters`: a replica's LoRA adapters, received, added, used and removed
    control.py    `RunControl`: clean stop, trainer heartbeat, abort of in-flight generations (a Ray actor)
    aborts.py     `ReplicaControl`: a replica's end of the run control, its abort loop
    shared.py     what the hub and the run control share: waits for a change, calls to an actor or object
    actors.py     both as named Ray actors of one run (Ray)

Importing the package registers the built-in transports ("broadcast", "ipc", "pairwise") in `transport.TRANSPORTS`.
"""

from app.weights import broadcast as broadcast  # registers "broadcast"
from app.weights import ipc as ipc  # registers "ipc" (trainer and replicas on one GPU)
from app.weights import pairwise as pairwise  # registers "pairwise" (replicas that share a GPU)
