"""A micro-batch's token log-probs (and entropies) under a model, on the micro-batch's grid.

Two paths: the chunked one (`scored_logprobs`: the output head on the response positions only, no full logits;
padded and packed micro-batches) and the reference one (`response_logprobs`: full float32 logits of a padded
micro-batch). Micro-batches come from app/trainer/batch_tensors.py `collate` or app/trainer/packing.py
`collate_packed`.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from app.trainer import grpo
from app.trainer.packing import packed_model_kwargs


def response_logprobs(
    model: torch.nn.Module, mb: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference path: full float32 logits of a padded micro-batch, then `grpo.token_logprobs`."""
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits[:, :-1].float()
    return grpo.token_logprobs(logits, mb["targets"]), logits


def scored_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    score_idx: torch.Tensor,
    score_targets: torch.Tensor,
    chunk_tokens: int,
    with_entropy: bool,
    entropy_grad: bool = False,
    **model_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Base model forward, then the output head on the scored positions only, chunked (no full logits).

    Bound to the model as `relay_scored_logprobs` (an FSDP2 forward method: the output embedding, tied or
    not, is gathered while it runs and its gradient reduced like any other).
    """
    hidden = model.base_model(input_ids=input_ids, **model_kwargs).last_hidden_state
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, score_idx)
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise NotImplementedError("chunked log-probs assume an output embedding without bias")
    fused = getattr(model, "relay_compiled", False)
    return grpo.chunked_token_logprobs(
        h, head.weight, score_targets, chunk_tokens, with_entropy, fused, entropy_grad
    )


def scored_logprobs(
    model: torch.nn.Module,
    mb: dict[str, Any],
    chunk_tokens: int,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token log-probs (and entropy, with a gradient only with `entropy_grad`) of a micro-batch's response
    tokens, laid out on its grid (`mb["mask"]`'s shape; 0 elsewhere). Works on padded (`batch_tensors.collate`)
    and packed (`app.trainer.packing.collate_packed`) micro-batches, on FSDP2 models from
    `model_build.build_fsdp_model` and on plain HF models."""
    kw = packed_model_kwargs(mb) if "packed" in mb else {"attention_mask": mb["attention_mask"]}
    fwd = getattr(model, "relay_scored_logprobs", None) or types.MethodType(scored_forward, model)
    ids, idx, tgt = mb["input_ids"], mb["score_idx"], mb["score_targets"]
    logp, ent = fwd(ids, idx, tgt, chunk_tokens, with_entropy, entropy_grad, **kw)
    mask = mb["mask"]

    def grid(v: torch.Tensor) -> torch.Tensor:
        return (
            torch.zeros(mask.numel(), dtype=v.dtype, device=v.device)
            .index_copy(0, mb["grid_idx"], v)
            .view_as(mask)
        )

    return grid(logp), (grid(ent) if ent is not None else None)


def micro_logprobs(
    model: torch.nn.Module,
    mb: dict[str, Any],
    chunk_tokens: int,
    reference_path: bool,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token log-probs (and entropy: with a gradient only with `entropy_grad`) on the micro-batch's grid:
    chunked (`scored_logprobs`), or with `reference_path` from full logits (`response_logprobs`)."""
    if not reference_path:
        return scored_logprobs(model, mb, chunk_tokens, with_entropy, entropy_grad)
    logp, logits = response_logprobs(model, mb)
    ent = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = grpo.entropy_from_logits(logits)
    return logp, ent
