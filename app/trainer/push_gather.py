"""Full tensors of many FSDP2 parameters in one all-gather (the weight push's gather on several trainer ranks).

FSDP2 shards each parameter on dim 0 the way `torch.chunk` splits it across the W ranks: rank r holds rows
[r*c, min((r+1)*c, n)) with c = ceil(n / W), possibly none. Gathering each parameter with `full_tensor()` is one
collective per parameter (340 of them for a 1.5B model on two ranks). Here
every rank packs its shards, each padded to c rows and cast to the pushed dtype, into one flat buffer; one
`all_gather_single` gives every rank every shard, and each full tensor is cut out of the (W, total) grid.
`gather_params` is the trainer's entry: named parameters in, full tensors out (those not sharded that way, one
by one).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Piece:
    """Where one parameter's padded shard lies in each rank's flat buffer."""

    offset: int
    rows: int  # c: the padded shard's rows
    shape: tuple[int, ...]  # the full parameter's shape

    @property
    def numel(self) -> int:
        return self.rows * math.prod(self.shape[1:])


def pack_shards(
    local: Sequence[torch.Tensor], shapes: Sequence[tuple[int, ...]], world: int, dtype: torch.dtype
) -> tuple[torch.Tensor, list[Piece]]:
    """This rank's shards (`local[i]` of the parameter of full shape `shapes[i]`) padded and cast into one flat
    buffer (one `torch.cat`), and where each lies."""
    parts: list[torch.Tensor] = []
    pieces: list[Piece] = []
    offset = 0
    for t, shape in zip(local, shapes, strict=True):
        rows = -(-shape[0] // world)
        piece = Piece(offset, rows, tuple(shape))
        parts.append(t.reshape(-1))
        missing = piece.numel - t.numel()
        if missing:  # a short (or empty) last shard: zeros up to c rows
            parts.append(torch.zeros(missing, dtype=dtype, device=t.device))
        pieces.append(piece)
        offset += piece.numel
    device = local[0].device if local else torch.device("cpu")
    flat = torch.empty(offset, dtype=dtype, device=device)
    if parts:
        torch.cat(parts, out=flat)
    return flat, pieces


def unpack_gathered(gathered: torch.Tensor, pieces: Sequence[Piece], world: int) -> list[torch.Tensor]:
    """Each full tensor out of every rank's flat buffer, `gathered` being those buffers back to back."""
    grid = gathered.view(world, -1)
    out = []
    for p in pieces:
        block = grid[:, p.offset : p.offset + p.numel].reshape(world * p.rows, *p.shape[1:])
        out.append(block[: p.shape[0]])
    return out


def gather_sharded(
    local: Sequence[torch.Tensor],
    shapes: Sequence[tuple[int, ...]],
    world: int,
    dtype: torch.dtype,
    all_gather: Callable[[torch.Tensor, torch.Tensor], None],
) -> list[torch.Tensor]:
    """The full tensors of dim-0 shards `local` (see the module docstring) through one `all_gather(out, flat)`
    (torch.distributed's `all_gather_single` on the shards' group: every rank calls it)."""
    flat, pieces = pack_shards(local, shapes, world, dtype)
    gathered = torch.empty(world * flat.numel(), dtype=dtype, device=flat.device)
    all_gather(gathered, flat)
    return unpack_gathered(gathered, pieces, world)


def _dim0_sharded(p: Any) -> bool:
    """An FSDP2 parameter sharded on dim 0 over a 1-D mesh of several ranks (what `gather_sharded` gathers)."""
    placements = getattr(p, "placements", None)
    if not placements or len(placements) != 1 or p.device_mesh.ndim != 1 or p.device_mesh.size() < 2:
        return False
    from torch.distributed.tensor import Shard

    return isinstance(placements[0], Shard) and placements[0].dim == 0


def gather_params(
    params: Mapping[str, Any], names: list[str], dtype: torch.dtype, cast: bool = True
) -> list[torch.Tensor]:
    """Full tensors of the parameters `params[n]` for `names` (collective: every rank calls this in lock-step),
    in `dtype` (`cast=False`: as the trainer holds them; a push's pack casts while it copies).

    Under no_grad a DTensor's `to_local()` is its local tensor, with no dispatch (a `detach()` first went
    through DTensor's dispatcher for every tensor). On several ranks the dim-0 shards of all `names` come in one
    all-gather (`gather_sharded`), in `dtype`."""
    out: dict[str, torch.Tensor] = {}
    sharded = [n for n in names if _dim0_sharded(params[n])]
    sharded = [n for n in sharded if params[n].device_mesh == params[sharded[0]].device_mesh]
    with torch.no_grad():
        if sharded:  # one all-gather for all of them, already in the pushed dtype
            # `all_gather_single` where torch has it (2.13 deprecates `all_gather_into_tensor`), else the old name
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            mesh = params[sharded[0]].device_mesh
            full = gather_sharded(
                [params[n].to_local() for n in sharded],
                [tuple(params[n].shape) for n in sharded],
                mesh.size(),
                dtype,
                lambda o, i: gather(o, i, group=mesh.get_group()),
            )
            out.update(zip(sharded, full, strict=True))
        for n in names:
            if n in out:
                continue
            p = params[n]
            if not hasattr(p, "full_tensor"):
                t = p.detach()
            elif p.device_mesh.size() == 1:  # one rank holds it whole: no all-gather
                t = p.to_local()
            else:
                t = p.full_tensor()
            out[n] = t.to(dtype) if cast else t
    return [out[n] for n in names]
