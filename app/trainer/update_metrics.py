"""One optimizer step's metrics, from token-weighted sums: each micro-batch adds its sums on the device (no host
synchronisation inside the micro-batch loop), the ranks sum them once, and the metrics divide them by the loss
tokens (app/trainer/minibatch.py `merge_updates` combines several updates' metrics into the step's)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from app.trainer.losses import LossInputs, LossOutputs

# token-weighted sums a step accumulates over micro-batches (then divided by the token count)
SUMS = ("loss", "kl", "entropy", "clipped", "tokens", "mismatch", "is_weight", "ppo_kl")


def micro_sums(
    inp: LossInputs, out: LossOutputs, kl_tok: torch.Tensor, ent: torch.Tensor | None, weight: float
) -> torch.Tensor:
    """One micro-batch's sums (`SUMS`, over its loss tokens, times `weight`) and its is-weight max, as one
    float64 device tensor."""
    with torch.no_grad():
        logp, prox = inp.logprobs, inp.proximal_logprobs
        m = inp.mask * weight
        ent = torch.zeros_like(m) if ent is None else ent.detach()
        drift = torch.zeros_like(m) if prox is None else prox - logp.detach()
        per_tok = (out.loss_tok, kl_tok, ent, out.clipped.float(), torch.ones_like(m))
        per_tok += ((logp - inp.behaviour_logprobs).abs(), out.is_weight, drift)
        vals = torch.stack([(x * m).sum() for x in per_tok])
        w_max = torch.where(m > 0, out.is_weight, torch.zeros_like(m)).max()  # weights are >= 0
        return torch.cat([vals, w_max[None]]).double()


def reduce_sums(sums: torch.Tensor) -> torch.Tensor:
    """Sums over ranks (the last entry, the is-weight max, is a max), read back to the host once."""
    if dist.is_initialized():
        red, mx = sums[:-1].clone(), sums[-1:].clone()
        dist.all_reduce(red)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        sums = torch.cat([red, mx])
    return sums.cpu()


def update_metrics(
    sums: torch.Tensor, grad_norm: float, total_tokens: float, entropy_coef: float, lr: float
) -> dict[str, float]:
    """One update's metrics from its reduced sums (`reduce_sums`), gradient norm, loss tokens and learning rate."""
    s = dict(zip(SUMS, sums.tolist(), strict=False))
    tok = max(1.0, s["tokens"])
    bonus = {"loss/entropy_bonus": -entropy_coef * s["entropy"] / tok} if entropy_coef > 0 else {}
    return {
        **bonus,
        "loss/policy": s["loss"] / tok,
        "loss/kl": s["kl"] / tok,
        "actor/entropy": s["entropy"] / tok,
        "actor/clip_frac": s["clipped"] / tok,
        "actor/grad_norm": grad_norm,
        "actor/logprob_mismatch": s["mismatch"] / tok,
        "actor/is_weight_mean": s["is_weight"] / tok,
        "actor/is_weight_max": float(sums[-1]),
        "actor/ppo_kl": s["ppo_kl"] / tok,
        "actor/lr": lr,
        "train/skipped_steps": 0.0 if math.isfinite(grad_norm) else 1.0,
        "train/tokens": total_tokens,
    }
