"""The pairwise broadcast transport ("pairwise"): trainer rank 0 sends each bucket to every receiver over that
receiver's own two-rank group, for replicas that share a GPU.

NCCL refuses a communicator with two ranks on one device, so the one-group `broadcast` cannot reach two vLLM
engines on one GPU. Yet two engines on a rollout GPU generate about 1.5x the tokens of one where an engine's
decode steps are bound by its own processes' CPU work (docs/benchmarks.md, "two engines on one GPU"). Here
each receiver rank r of the epoch forms a group with rank 0 alone (`relay-weights/{epoch}/pair{r}`, on the
epoch's one TCPStore), and rank 0 starts one broadcast of a bucket per pair: the trainer sends the bytes once
per receiver (2 x 3.1 GB at 1.5B, two engines), every pair on its own NCCL stream. Everything else is
`broadcast`'s walk: double-buffered buckets, checksums in flight, the receive queued behind the transfer, one
deadline per pair.
"""

from __future__ import annotations

from typing import Any

import torch

from app.weights.broadcast import BroadcastTransport
from app.weights.group import StatelessGroup
from app.weights.records import GroupInfo, SyncError
from app.weights.transport import register_transport


class PairGroups:
    """One end of an epoch's pairs, used by the broadcast walk as one group: rank 0 holds a pair with every
    receiver (ranks 1..world-1), a receiver its one pair. `rank` and `store` are the epoch's (the ack board
    keys answers by the weight-group rank); works are (pair, work) so each is waited for on its own pair."""

    def __init__(self, info: GroupInfo, rank: int, device: torch.device | str) -> None:
        self.rank, self.world, self.device = rank, info.world, torch.device(device)
        self.pairs: dict[int, StatelessGroup] = {}
        store = None
        try:
            for peer in range(1, info.world) if rank == 0 else [rank]:
                self.pairs[peer] = g = StatelessGroup(
                    info.host,
                    info.port,
                    0 if rank == 0 else 1,
                    2,
                    info.backend,
                    info.timeout_s,
                    info.epoch,
                    device,
                    high_priority=info.high_priority,
                    store=store,
                    tag=f"/pair{peer}",
                )
                store = g.store
        except Exception:
            self.close()
            raise
        self.store = store

    def broadcast_async(self, t: torch.Tensor) -> list[tuple[int, Any]]:
        """Start `t`'s broadcast on every pair: rank 0 sends it to each receiver, a receiver fills it."""
        return [(peer, g.broadcast_async(t)) for peer, g in self.pairs.items()]

    def follow(self, work: tuple[int, Any]) -> None:
        self._on_pair(work, "follow")

    def wait(self, work: tuple[int, Any]) -> None:
        self._on_pair(work, "wait")

    def _on_pair(self, work: tuple[int, Any], how: str) -> None:
        peer, w = work
        try:
            getattr(self.pairs[peer], how)(w)
        except Exception as e:  # gloo's and NCCL's own errors too: the news is which receiver failed
            end = "to" if self.rank == 0 else "from rank 0 to"
            raise SyncError(f"pairwise push {end} weight-group rank {peer} failed: {e}") from e

    def close(self) -> None:
        for g in self.pairs.values():
            g.close()
        self.pairs = {}


@register_transport("pairwise")
class PairwiseTransport(BroadcastTransport):
    """`broadcast`'s walk over one two-rank group per receiver (`PairGroups`); picked by `sync.transport=auto`
    where GPU replicas share a GPU and the trainer has GPUs of its own (app/infra/resources.py)."""

    def start(self, flat: torch.Tensor) -> list[Any]:
        return self.group.broadcast_async(flat)  # type: ignore[union-attr]

    def _connect(self, info: GroupInfo, rank: int, device: torch.device | str) -> None:
        self.close()
        self.group = PairGroups(info, rank, device)  # type: ignore[assignment]
