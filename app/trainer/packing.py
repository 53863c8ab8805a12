"""Padding-free micro-batches: sequences packed end to end into one row, attention kept inside each sequence.

`plan_micro_batches` splits a step's rows over FSDP ranks and into token-budget micro-batches
(`train.micro_batch_tokens`); `collate_packed` lays one micro-batch out as a single row of concatenated
sequences, with position ids restarting at every sequence and the cumulative sequence lengths that the
attention needs.

Attention boundaries. Transformers' own packed-sequence detection (restarting `position_ids`, no
`attention_mask`) builds a `[T, T]` mask per forward, costs a host synchronisation, and on transformers 5.19
with sdpa/eager on CPU did not keep sequences apart (a later sequence's logits differed by 0.46 from its
own forward). So the packed forward passes a mask mapping of `None`s (no mask is built) and a
`PackedSeqs` record that reaches our attention function, registered with transformers' `AttentionInterface`
as ``relay_packed``:

* ``varlen``: `torch.nn.attention.varlen.varlen_attn` (FlashAttention's varlen kernel: one call over
  every sequence, causal inside each), on CUDA in bf16/fp16;
* ``per_seq``: one causal `scaled_dot_product_attention` per sequence (exact on any device and dtype; the
  CPU path, and the GPU fallback where varlen is missing).

``auto`` takes varlen where it applies, else per_seq. Calls without a `PackedSeqs` (padded batches: the
reference forward, `Learner.logprobs_of`) go to transformers' sdpa attention with its usual mask.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

ATTN_NAME = "relay_packed"
PACKED_ATTENTION = ("auto", "varlen", "per_seq")


@dataclass
class PackedSeqs:
    """Sequence boundaries of a packed row: `cu` on the device (int32), `cu_host` the same on the host."""

    cu: torch.Tensor
    cu_host: list[int]
    max_len: int
    mode: str = "auto"


# ---------------------------------------------------------------- planning


def plan_micro_batches(
    lengths: list[int], world: int, budget: int, max_rows: int = 0
) -> list[list[list[int]]]:
    """Row indices per rank, per micro-batch: ``plan[rank][k]`` is rank ``rank``'s k-th micro-batch.

    Rows go to ranks longest first, each to the rank with the fewest tokens so far (balanced work), then
    each rank's rows are packed first-fit (longest first) into micro-batches of at most ``budget`` tokens
    and, with ``max_rows > 0``, at most ``max_rows`` rows (`train.micro_batch_size`); a row longer than the
    budget gets a micro-batch of its own. Deterministic: every rank computes the same plan from the same
    lengths, so the ranks agree on how many passes each runs.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    per_rank: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in order:
        r = min(range(world), key=lambda k: (load[k], k))
        per_rank[r].append(i)
        load[r] += lengths[i]
    plan: list[list[list[int]]] = []
    for mine in per_rank:
        bins: list[list[int]] = []
        room: list[int] = []
        for i in mine:
            k = next(
                (
                    b
                    for b, free in enumerate(room)
                    if free >= lengths[i] and (max_rows <= 0 or len(bins[b]) < max_rows)
                ),
                None,
            )
            if k is None:
                bins.append([i])
                room.append(budget - lengths[i])
            else:
                bins[k].append(i)
                room[k] -= lengths[i]
        plan.append([sorted(b) for b in bins])
    return plan


# ---------------------------------------------------------------- layout


def collate_packed(rows: list[Any], device: torch.device, mode: str = "auto") -> dict[str, Any]:
    """One packed micro-batch of `Row`s (app/trainer/learner.py): model inputs and response-aligned grids.

    Model inputs: `input_ids` and `position_ids` ``[1, T]`` (T = total tokens), `packed` (`PackedSeqs`).
    Scoring: `score_idx` ``[R]`` (positions in the packed row whose next token is a response token),
    `score_targets` ``[R]``, `grid_idx` ``[R]`` (where each lands in the grid). Grids ``[S, L]`` (S rows, L
    the longest response): `mask`, `old`, `adv`, and `ref` when every row has reference log-probs. Response
    token j of row i sits at grid ``[i, j]``, so the loss and its aggregation see the same per-sequence
    tokens as with padding.
    """
    s = len(rows)
    width = max(len(r.response_ids) for r in rows)
    ids, pos, cu = [], [], [0]
    score_idx, targets, grid_idx = [], [], []
    mask = torch.zeros((s, width), dtype=torch.float32)
    old, adv, ref = torch.zeros_like(mask), torch.zeros_like(mask), torch.zeros_like(mask)
    has_ref = all(r.ref_logprobs is not None for r in rows)
    for i, r in enumerate(rows):
        seq = list(r.prompt_ids) + list(r.response_ids)
        p, n, off = len(r.prompt_ids), len(r.response_ids), cu[-1]
        ids += seq
        pos += range(len(seq))
        cu.append(off + len(seq))
        score_idx += range(off + p - 1, off + p - 1 + n)
        targets += r.response_ids
        grid_idx += range(i * width, i * width + n)
        mask[i, :n] = r.mask()
        old[i, :n] = torch.tensor(r.behaviour_logprobs, dtype=torch.float32)
        adv[i, :n] = r.advantage
        if has_ref:
            ref[i, :n] = torch.tensor(r.ref_logprobs, dtype=torch.float32)
    out = {
        "input_ids": torch.tensor([ids], dtype=torch.long),
        "position_ids": torch.tensor([pos], dtype=torch.long),
        "cu": torch.tensor(cu, dtype=torch.int32),
        "score_idx": torch.tensor(score_idx, dtype=torch.long),
        "score_targets": torch.tensor(targets, dtype=torch.long),
        "grid_idx": torch.tensor(grid_idx, dtype=torch.long),
        "mask": mask,
        "old": old,
        "adv": adv,
    }
    if has_ref:
        out["ref"] = ref
    out = to_device(out, device)
    max_len = max(b - a for a, b in itertools.pairwise(cu))
    out["packed"] = PackedSeqs(cu=out.pop("cu"), cu_host=cu, max_len=max_len, mode=mode)
    return out


def to_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Host tensors to `device` without a host synchronisation (pinned, asynchronous copies on CUDA)."""
    if device.type != "cuda":
        return {k: v.to(device) for k, v in tensors.items()}
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in tensors.items()}


# ---------------------------------------------------------------- attention


@functools.cache
def _varlen_fn() -> Any | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _varlen_kwargs(fn: Any) -> dict[str, Any]:
    """Causal masking is `window_size=(-1, 0)` in newer torch and `is_causal=True` in older releases."""
    params = inspect.signature(fn).parameters
    if "window_size" in params:
        kw: dict[str, Any] = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        kw = {"is_causal": True}
    else:
        raise RuntimeError("torch.nn.attention.varlen.varlen_attn takes neither window_size nor is_causal")
    if "enable_gqa" in params:
        kw["enable_gqa"] = True
    return kw


def _use_varlen(query: torch.Tensor, mode: str) -> bool:
    ok = query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and _varlen_fn() is not None
    if mode == "varlen" and not ok:
        raise RuntimeError(
            "train.packed_attention=varlen needs CUDA, bf16/fp16 compute and torch.nn.attention.varlen; "
            "use auto or per_seq"
        )
    return ok and mode in ("auto", "varlen")


def _varlen(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, p: PackedSeqs, scale: Any
) -> torch.Tensor:
    fn = _varlen_fn()
    # [1, heads, T, dim] -> [T, heads, dim]
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
    out = fn(q, k, v, p.cu, p.cu, p.max_len, p.max_len, scale=scale, **_varlen_kwargs(fn))
    return out.unsqueeze(0)


def _per_seq(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, p: PackedSeqs, scale: Any
) -> torch.Tensor:
    outs = []
    for a, b in itertools.pairwise(p.cu_host):
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                query[:, :, a:b],
                key[:, :, a:b],
                value[:, :, a:b],
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
        )
    return torch.cat(outs, dim=2).transpose(1, 2)  # [1, T, heads, dim]


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers attention function: packed rows (a `relay_packed` kwarg) attend within each sequence;
    anything else is transformers' sdpa attention. Returns ``[1, T, heads, dim]`` like sdpa."""
    p = kwargs.pop("relay_packed", None)
    if p is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("packed micro-batches with sliding-window attention layers")
    if dropout:
        raise NotImplementedError("packed micro-batches with attention dropout")
    fn = _varlen if _use_varlen(query, p.mode) else _per_seq
    return fn(query, key, value, p, scaling).contiguous(), None


def enable_packed_attention(model: torch.nn.Module) -> None:
    """Route `model`'s attention through `packed_attention` (padded calls keep sdpa and its masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, packed_attention)
    AttentionMaskInterface.register(ATTN_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(ATTN_NAME)


def packed_model_kwargs(mb: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of the base model's forward for a packed micro-batch: no mask is built (a mapping of
    `None`s per layer type) and the boundaries travel to `packed_attention`."""
    none_masks = {"full_attention": None, "sliding_attention": None}
    return {"position_ids": mb["position_ids"], "attention_mask": none_masks, "relay_packed": mb["packed"]}
