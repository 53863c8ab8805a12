"""Pure PyTorch GRPO math: group advantages, clipped surrogate, KL penalties, loss aggregation.

No Ray, vLLM or config imports: every function here is a pure tensor function so it can be unit tested
on CPU against hand-computed values. Shape conventions: ``B`` sequences, ``T`` tokens, ``V`` vocab,
``G`` prompt groups of ``n`` samples. ``mask`` arguments are 0/1 (bool or float) tensors; masked
positions never contribute to a result, even if the other inputs hold ``nan``/``inf`` there.
Log-ratios are clamped to ``[-max_log_ratio, max_log_ratio]`` before every ``exp`` so that huge
policy drifts give large but finite values (and zero gradient beyond the clamp).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

KL_KINDS = ("k1", "k3", "low_var_kl")
AGG_MODES = ("token_mean", "seq_mean")


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is nonzero (over ``dim``, or all elements if None).

    The count is clamped to >= 1, so an all-masked input gives 0 rather than nan.
    """
    m = mask.bool()
    total = torch.where(m, x, torch.zeros_like(x))
    count = m.sum() if dim is None else m.sum(dim)
    total = total.sum() if dim is None else total.sum(dim)
    return total / count.clamp(min=1).to(total.dtype)


def group_advantages(rewards: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages for rewards of shape ``[G, n]`` (G groups of n samples of one prompt).

    Returns ``(r - mean_g) / (std_g + eps)`` if ``normalize_std`` else ``r - mean_g``, with ``std_g``
    the *population* std of the group (``correction=0``). Groups whose rewards are all equal (including
    n == 1) give exactly 0, with no rounding noise amplified by ``1 / eps``. Output is float, ``[G, n]``.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must have shape [G, n], got {tuple(rewards.shape)}")
    r = rewards if rewards.is_floating_point() else rewards.float()
    adv = r - r.mean(dim=-1, keepdim=True)
    if normalize_std:
        adv = adv / (r.std(dim=-1, correction=0, keepdim=True) + eps)
    same = (r == r[:, :1]).all(dim=-1, keepdim=True)
    return torch.where(same, torch.zeros_like(adv), adv)


def clamped_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, max_log_ratio: float = 20.0
) -> torch.Tensor:
    """``exp(clamp(logprobs - old_logprobs, -max_log_ratio, max_log_ratio))``, elementwise."""
    return torch.exp((logprobs - old_logprobs).clamp(-max_log_ratio, max_log_ratio))


def _clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``-min(ratio*A, clip(ratio, 1-clip_low, 1+clip_high)*A)`` and the active-clip mask.

    With ``clip_ratio_c`` (dual-clip), a token with ``A < 0`` has its loss capped at ``clip_ratio_c * |A|``
    (a huge ratio on a bad token is otherwise unbounded); such tokens count as clipped too.
    """
    surr = ratio * advantages
    surr_clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    m = mask.bool()
    clipped = (surr_clipped < surr) & m  # the clipped term is the strictly smaller (active) one
    loss = -torch.where(clipped, surr_clipped, surr)
    if clip_ratio_c is not None:
        cap = -advantages * clip_ratio_c
        dual = (advantages < 0) & (loss > cap) & m
        loss = torch.where(dual, cap, loss)
        clipped = clipped | dual
    return torch.where(m, loss, torch.zeros_like(loss)), clipped


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    max_log_ratio: float = 20.0,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token; all inputs ``[B, T]`` (advantages already broadcast per token).

    ``ratio = clamped_ratio(logprobs, old_logprobs)`` (``old_logprobs`` is detached) and
    ``loss_tok = -min(ratio*A, clip(ratio, 1-clip_low, 1+clip_high)*A)`` (asymmetric "clip-higher"), capped
    at ``clip_ratio_c * |A|`` for ``A < 0`` when ``clip_ratio_c`` is given (dual-clip).
    Returns ``(loss_tok, clipped)``: ``loss_tok`` is ``[B, T]`` with masked positions 0; ``clipped`` is a
    ``[B, T]`` bool tensor, True where a clipped term is the active one and differs from the unclipped
    term (those tokens have zero gradient), always False at masked positions. Unclipped tokens have
    gradient ``-A * ratio`` w.r.t. ``logprobs``.
    """
    ratio = clamped_ratio(logprobs, old_logprobs.detach(), max_log_ratio)
    return _clipped_surrogate(ratio, advantages, mask, clip_low, clip_high, clip_ratio_c)


def tis_weights(
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    cap: float | None = 2.0,
    max_log_ratio: float = 20.0,
) -> torch.Tensor:
    """Truncated importance weights ``min(exp(clamp(prox - behav)), cap)``, detached (no gradient).

    ``cap=None`` leaves them untruncated (AReaL's decoupled loss).
    """
    w = clamped_ratio(proximal_logprobs.detach(), behaviour_logprobs.detach(), max_log_ratio)
    return w if cap is None else w.clamp(max=cap)


def decoupled_policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    cap: float | None = None,
    max_log_ratio: float = 20.0,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """AReaL decoupled PPO loss for off-policy (async) samples; all inputs ``[B, T]``.

    The trust region is taken against the proximal policy: ``ratio = exp(clamp(logp - prox))`` is
    clipped exactly as in :func:`policy_loss`, and each token's surrogate is multiplied by the behaviour
    importance weight :func:`tis_weights` ``(prox, behav, cap)`` (detached; truncated at ``cap`` if given).
    ``proximal_logprobs`` and ``behaviour_logprobs`` are detached. With ``prox == behav`` this equals
    :func:`policy_loss`. Returns ``(loss_tok, clipped)`` with the same contract as :func:`policy_loss`.
    """
    loss, clipped = policy_loss(
        logprobs, proximal_logprobs, advantages, mask, clip_low, clip_high, max_log_ratio, clip_ratio_c
    )
    return loss * tis_weights(proximal_logprobs, behaviour_logprobs, cap, max_log_ratio), clipped


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str, max_log_ratio: float = 20.0
) -> torch.Tensor:
    """Per-token KL(policy || ref) estimate from sampled-token log-probs (same shape as inputs).

    Every estimator first clamps the log-ratio ``ref - logp`` to ``[-max_log_ratio, max_log_ratio]``: a
    large trainer/reference mismatch (or a ``-inf`` log-prob) then gives a large but finite value, never an
    ``inf`` that a mask turns into ``nan``. ``"k1"``: ``logp - ref``. ``"k3"``: ``exp(ref - logp) -
    (ref - logp) - 1`` (>= 0). ``"low_var_kl"``: k3 with the log-ratio clamped to [-20, 20] and the result
    clamped to [-10, 10] (as in verl). All are 0 where ``logprobs == ref_logprobs``. Unknown ``kind``
    raises ValueError.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown kl kind {kind!r}; valid kinds: {', '.join(KL_KINDS)}")
    log_ratio = (ref_logprobs - logprobs).clamp(-max_log_ratio, max_log_ratio)
    if kind == "k1":
        return -log_ratio
    if kind == "k3":
        return torch.exp(log_ratio) - log_ratio - 1.0
    log_ratio = log_ratio.clamp(-20.0, 20.0)
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-10.0, 10.0)


def aggregate(
    loss_tok: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar.

    ``"token_mean"``: ``sum(loss * mask) / D`` with ``D = num_tokens`` if given (a global token count
    across ranks / micro-batches, so that summing per-micro-batch results gives the global mean) else
    ``mask.sum()``. ``"seq_mean"``: each sequence's mean over its own unmasked tokens, summed over
    sequences and divided by ``num_seqs`` if given else ``B`` (an all-masked sequence contributes 0).
    Every denominator is clamped to >= 1. Unknown ``mode`` raises ValueError.
    """
    m = mask.bool()
    masked = torch.where(m, loss_tok, torch.zeros_like(loss_tok))
    if mode == "token_mean":
        if num_tokens is None:
            return masked.sum() / m.sum().clamp(min=1).to(masked.dtype)
        return masked.sum() / max(float(num_tokens), 1.0)
    if mode == "seq_mean":
        per_seq = masked.sum(dim=-1) / m.sum(dim=-1).clamp(min=1).to(masked.dtype)
        denom = float(loss_tok.shape[0]) if num_seqs is None else float(num_seqs)
        return per_seq.sum() / max(denom, 1.0)
    raise ValueError(f"unknown aggregation mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last dim: ``[..., V] -> [...]``, in float32.

    Computed stably as ``logsumexp(l) - sum(softmax(l) * l)``, so very large logits do not overflow.
    Logits are expected to be finite.
    """
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)`` gathered at ``tokens``: ``[B, T, V], [B, T] -> [B, T]``, in float32.

    Computed as ``logits[token] - logsumexp(logits)`` to avoid materialising a full log-softmax.
    """
    logits = logits.float()
    picked = torch.gather(logits, -1, tokens.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)
