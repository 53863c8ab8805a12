"""A batch as the learner's tensors: GRPO advantages and one `Row` per sample, rows split into each rank's
micro-batches, a padded micro-batch's tensors (packed ones: app/trainer/packing.py `collate_packed`), and one
optimizer step's micro-batches (`Update`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from app.records import Batch
from app.trainer import grpo
from app.trainer.packing import plan_micro_batches, to_device


@dataclass
class Row:
    """One trained sample: its prompt and response tokens, behaviour log-probs, advantage and versions."""

    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    advantage: float
    versions: list[int]
    ref_logprobs: list[float] | None = None  # from the reference workers (ref.workers > 0)
    loss_mask: list[int] | None = None  # 0 on environment tokens of a multi-turn trajectory

    def mask(self) -> torch.Tensor:
        """1 on the response tokens the loss sees (model tokens), 0 on environment tokens."""
        if self.loss_mask is None:
            return torch.ones(len(self.response_ids), dtype=torch.float32)
        return torch.tensor(self.loss_mask, dtype=torch.float32)

    @property
    def loss_tokens(self) -> int:
        return len(self.response_ids) if self.loss_mask is None else int(sum(self.loss_mask))


@dataclass
class Update:
    """One optimizer step's micro-batches on this rank, on the device. `n_micro` passes run on every rank;
    past its own micro-batches a rank runs zero-weight passes on `filler`. `tokens` and `seqs` count the
    whole update's (every rank's) loss tokens and sequences: the loss's global denominators."""

    mbs: list[dict[str, Any]]
    n_micro: int
    filler: dict[str, Any] | None
    tokens: float
    seqs: float

    def passes(self) -> list[tuple[dict[str, Any], float]]:
        """(micro-batch, weight) of each pass, in order."""
        return [(self.mbs[k], 1.0) if k < len(self.mbs) else (self.filler, 0.0) for k in range(self.n_micro)]


def flatten_batch(batch: Batch, normalize_std: bool) -> list[Row]:
    """GRPO advantages per group, then one row per sample (groups kept in order)."""
    rows: list[Row] = []
    for g in batch.groups:
        rewards = torch.tensor([[s.reward for s in g.samples]], dtype=torch.float32)
        adv = grpo.group_advantages(rewards, normalize_std=normalize_std)[0].tolist()
        for s, a in zip(g.samples, adv, strict=True):
            if not s.token_ids:
                continue
            rows.append(
                Row(g.prompt_ids, s.token_ids, s.logprobs, a, s.versions, s.ref_logprobs, s.loss_mask)
            )
    return rows


def collate(rows: list[Row], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded input ids plus response-aligned targets: position t predicts token t+1.

    Grids (`targets`, `mask`, `old`, `adv`, `ref`) are ``[B, W-1]``; `score_idx`, `score_targets` and
    `grid_idx` list the response positions for `scored_logprobs` (flat indices into the ``[B, W]`` hidden
    states and into the grid).
    """
    width = max(len(r.prompt_ids) + len(r.response_ids) for r in rows)
    b = len(rows)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    targets = torch.zeros((b, width - 1), dtype=torch.long)
    mask = torch.zeros((b, width - 1), dtype=torch.float32)
    old = torch.zeros((b, width - 1), dtype=torch.float32)
    adv = torch.zeros((b, width - 1), dtype=torch.float32)
    has_ref = bool(rows) and all(r.ref_logprobs is not None for r in rows)
    ref = torch.zeros((b, width - 1), dtype=torch.float32)
    resp = torch.zeros((b, width - 1), dtype=torch.bool)  # every response position (scored)
    for i, r in enumerate(rows):
        seq = list(r.prompt_ids) + list(r.response_ids)
        n, p = len(seq), len(r.prompt_ids)
        ids[i, :n] = torch.tensor(seq)
        attn[i, :n] = 1
        targets[i, : n - 1] = torch.tensor(seq[1:])
        sl = slice(p - 1, n - 1)
        mask[i, sl] = r.mask()
        resp[i, sl] = True
        old[i, sl] = torch.tensor(r.behaviour_logprobs, dtype=torch.float32)
        adv[i, sl] = r.advantage
        if has_ref:
            ref[i, sl] = torch.tensor(r.ref_logprobs, dtype=torch.float32)
    grid_idx = resp.flatten().nonzero().squeeze(1)  # b * (W-1) + t, on the host
    out = dict(input_ids=ids, attention_mask=attn, targets=targets, mask=mask, old=old, adv=adv)
    out.update(score_idx=grid_idx + grid_idx // (width - 1), score_targets=targets.flatten()[grid_idx])
    out["grid_idx"] = grid_idx
    if has_ref:
        out["ref"] = ref
    return to_device(out, device)


def row_values(mb: dict[str, Any], grid: torch.Tensor, i: int, row: Row) -> list[float]:
    """Row `i`'s response values (one per response token) from a grid of `collate` or `collate_packed`."""
    n = len(row.response_ids)
    start = 0 if "packed" in mb else len(row.prompt_ids) - 1
    return grid[i, start : start + n].tolist()


def split_rows(
    rows: list[Row], rank: int, world: int, packed: bool, micro_batch_tokens: int, micro_batch_size: int
) -> tuple[list[list[Row]], int]:
    """This rank's micro-batches and the number of passes every rank runs: packed, by token budget
    (`plan_micro_batches`), else padded, rows dealt round-robin and cut `micro_batch_size` at a time."""
    if packed:
        lengths = [len(r.prompt_ids) + len(r.response_ids) for r in rows]
        plan = plan_micro_batches(lengths, world, micro_batch_tokens, micro_batch_size)
        n_micro = max(1, max(len(p) for p in plan))
        return [[rows[i] for i in mb] for mb in plan[rank]], n_micro
    mine = rows[rank::world]
    most = math.ceil(len(rows) / world)  # the largest rank's share: the same on every rank
    mbs = micro_batch_size or max(1, most)  # 0: a rank's whole share in one pass
    n_micro = max(1, math.ceil(most / mbs))
    return [mine[k * mbs : (k + 1) * mbs] for k in range(n_micro) if mine[k * mbs : (k + 1) * mbs]], n_micro
