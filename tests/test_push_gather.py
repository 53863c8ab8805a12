"""The push's one-all-gather gather of FSDP2 dim-0 shards (app/trainer/push_gather.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("world", [2, 3, 4])
def test_push_gather_rebuilds_every_full_tensor_from_one_all_gather(world):
    """Each rank's dim-0 shards as FSDP2 holds them (torch.chunk: short or empty last shards) packed into one
    buffer; the ranks' buffers back to back (what all_gather_into_tensor gives) rebuild every full tensor, cast."""
    from app.trainer.push_gather import gather_sharded, pack_shards

    torch.manual_seed(0)
    full = [torch.randn(5, 3), torch.randn(1, 4), torch.randn(7), torch.randn(2), torch.randn(9, 2, 2)]
    shapes = [tuple(t.shape) for t in full]

    def shard(t: torch.Tensor, rank: int) -> torch.Tensor:
        chunks = torch.chunk(t, world, dim=0)
        return chunks[rank] if rank < len(chunks) else t[:0]

    flats = [pack_shards([shard(t, r) for t in full], shapes, world, torch.bfloat16)[0] for r in range(world)]

    def all_gather(out: torch.Tensor, mine: torch.Tensor) -> None:
        assert torch.equal(mine, flats[0])
        out.copy_(torch.cat(flats))

    got = gather_sharded([shard(t, 0) for t in full], shapes, world, torch.bfloat16, all_gather)
    for t, g in zip(full, got, strict=True):
        assert g.shape == t.shape and g.dtype == torch.bfloat16
        assert torch.equal(g, t.to(torch.bfloat16))
