"""The data-plane seam: how one push plan's buckets travel from trainer rank 0 to every receiver.

A transport is one process's end of one epoch of the weight group. The control plane (the hub) decides
membership, ranks and versions; the transport only moves bytes and reports checksums of what it moved, so a
new transport cannot weaken the protocol (acknowledgement with checksums, deadlines, versions only increase).

    trainer rank 0   open(info, device)   host the epoch (rank 0); returns once every receiver connected
    every trainer    send(plan, gather)   walk the buckets; gather is an FSDP2 collective on every rank,
                                          only an opened transport sends (`buckets.walk_buckets`)
    receiver worker  join(info, rank)     connect as `rank` of the epoch
                     receive(plan, load)  receive every bucket in order, hand its tensors to `load`
    both             close()              leave the epoch; a new epoch builds a new transport

A transport reads its own settings from the sync config (`bucket_mb(sync)`, `high_priority(sync)`): the
broadcast family's `sync.broadcast.*`, the CUDA-IPC transport's `sync.ipc.*`.

Transports are chosen by name (`sync.transport`, carried to the receivers in `GroupInfo.transport`) from
`TRANSPORTS`. A name `pkg.module:Name` imports `pkg.module` first (in the trainer and in every vLLM worker),
so a transport defined outside app/ registers itself on import and needs no edit here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from app.weights.records import GroupInfo, PushPlan, PushStats

if TYPE_CHECKING:
    from app.config.weights import SyncConfig

Gather = Callable[[list[str]], list[torch.Tensor]]
Load = Callable[[list[tuple[str, torch.Tensor]]], None]


@runtime_checkable
class WeightTransport(Protocol):
    """One end (trainer or receiver) of one epoch's data plane."""

    @staticmethod
    def bucket_mb(sync: SyncConfig) -> float:
        """The bucket size this transport walks with, in MiB, from its own section of `sync`."""
        ...

    @staticmethod
    def high_priority(sync: SyncConfig) -> bool:
        """Whether the epoch's NCCL broadcasts run on a high-priority stream (carried in `GroupInfo`)."""
        ...

    def open(self, info: GroupInfo, device: torch.device | str) -> None:
        """Trainer rank 0: host epoch `info.epoch` as rank 0; raise if a receiver does not connect in time."""
        ...

    def send(self, plan: PushPlan, gather: Gather, device: torch.device | str) -> PushStats:
        """Every trainer rank, the same plan in the same order. Raises SyncError after the whole walk."""
        ...

    def join(self, info: GroupInfo, rank: int, device: torch.device | str) -> None:
        """A receiver (one vLLM worker): connect to epoch `info.epoch` as `rank`."""
        ...

    def receive(
        self, plan: PushPlan, load: Load, device: torch.device | str
    ) -> tuple[list[str], dict[str, float]]:
        """Receive every bucket of `plan`; returns one checksum per bucket and timings (transfer_s, load_s)."""
        ...

    def close(self) -> None: ...


TRANSPORTS: dict[str, type[WeightTransport]] = {}


def register_transport(name: str) -> Callable[[type], type]:
    """Class decorator: make a transport selectable as `sync.transport=<name>`."""

    def add(cls: type) -> type:
        TRANSPORTS[name] = cls
        return cls

    return add


def transport_class(name: str) -> type[WeightTransport]:
    """The transport registered as `name`; `pkg.module:Name` imports the module first (which may register
    `Name`, or define a class of that name)."""
    from app.plugins import import_module, is_dotted, resolve

    if name not in TRANSPORTS and is_dotted(name):
        module, _, attr = name.partition(":")
        import_module(f"sync.transport={name!r}", module)  # it may register `attr` (the class decorator)
        if name not in TRANSPORTS:
            TRANSPORTS[name] = TRANSPORTS.get(attr) or resolve("sync.transport", name)
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise ValueError(
            f"sync.transport={name!r} is not a registered weight transport; registered: {sorted(TRANSPORTS)} "
            "(or name one as pkg.module:Name)"
        ) from None


def make_transport(name: str) -> WeightTransport:
    """A fresh, unconnected transport `name` (its process group's backend comes with `GroupInfo`)."""
    return transport_class(name)()
