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
from typing import Any

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


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` as float32: the matmul runs in the inputs' dtype (bf16 tensor cores on a GPU) and, where torch
    supports it, writes float32 results straight from its float32 accumulators."""
    if a.dtype in (torch.bfloat16, torch.float16) and a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError):  # a torch without mm(out_dtype=...) for this dtype
            pass
    return torch.mm(a, b).float()


def _head_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 logits ``hidden [c, H] @ weight.T [H, V]``."""
    return _mm_f32(hidden, weight.t())


def _chunk_stats(
    logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """log-sum-exp, target log-prob and (optionally) entropy of float32 ``logits [c, V]``."""
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    ent = None
    if with_entropy:
        ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
    return lse, logp, ent


def _chunk_grad(
    logits: torch.Tensor,
    lse: torch.Tensor,
    targets: torch.Tensor,
    grad_logp: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``d(grad_logp . logp) / d logits = grad_logp * (onehot(target) - softmax(logits))``, in ``dtype``."""
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    onehot = (vocab == targets.unsqueeze(-1)).to(logits.dtype)
    return ((onehot - torch.exp(logits - lse.unsqueeze(-1))) * grad_logp.unsqueeze(-1)).to(dtype)


def _chunk_grad_ent(
    logits: torch.Tensor,
    lse: torch.Tensor,
    targets: torch.Tensor,
    grad_logp: torch.Tensor,
    ent: torch.Tensor,
    grad_ent: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """`_chunk_grad` plus the entropy's share: ``dH / d logits_j = -p_j (log p_j + H)`` times ``grad_ent``."""
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    onehot = (vocab == targets.unsqueeze(-1)).to(logits.dtype)
    logp_all = logits - lse.unsqueeze(-1)
    p = torch.exp(logp_all)
    g = (onehot - p) * grad_logp.unsqueeze(-1) - p * (logp_all + ent.unsqueeze(-1)) * grad_ent.unsqueeze(-1)
    return g.to(dtype)


_COMPILED: dict[str, Any] = {}


def _fused(name: str, x: torch.Tensor) -> Any:
    """`torch.compile`d `_chunk_stats` / `_chunk_grad`: one or two kernels over a chunk of logits instead of
    one per operation (each a pass over ``[c, V]`` float32). Rows vary (the last chunk), the vocabulary not."""
    fn = _COMPILED.get(name)
    if fn is None:
        fns = {"stats": _chunk_stats, "grad": _chunk_grad, "grad_ent": _chunk_grad_ent}
        fn = _COMPILED[name] = torch.compile(fns[name])
    torch._dynamo.maybe_mark_dynamic(x, 0)
    return fn


def _part(t: torch.Tensor, s: int, e: int, fused: bool) -> torch.Tensor:
    """Rows ``s:e`` of a 1-D per-row tensor; for the compiled kernels a copy (storage offset 0), as a view's offset
    would be a guard of the compiled graph (0, then every later chunk's), one more compile per kind of offset."""
    return t[s:e].clone() if fused else t[s:e]


class _ChunkedLogprobs(torch.autograd.Function):
    """Target log-probs of ``hidden @ weight.T`` in chunks of rows; backward recomputes each chunk's logits.
    The entropy carries a gradient only with ``entropy_grad`` (an entropy bonus in the loss)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, with_entropy, fused, entropy_grad):
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        ent = hidden.new_zeros(n, dtype=torch.float32)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            logits = _head_logits(hidden[s:e], weight)
            stats = _fused("stats", logits) if fused else _chunk_stats
            c_lse, c_logp, c_ent = stats(logits, _part(targets, s, e, fused), with_entropy)
            lse[s:e], logp[s:e] = c_lse, c_logp
            if c_ent is not None:
                ent[s:e] = c_ent
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.chunk, ctx.fused, ctx.entropy_grad = chunk, fused, bool(entropy_grad and with_entropy)
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(ent)
        ctx.set_materialize_grads(False)  # an output the loss did not use gets None: no work for it
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        with_ent = ctx.entropy_grad and grad_ent is not None
        grad_h = torch.empty_like(hidden) if need_h else None
        # the weight's gradient sums over every chunk: accumulate in float32 whatever the compute dtype
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for s in range(0, hidden.shape[0], ctx.chunk):
            e = min(hidden.shape[0], s + ctx.chunk)
            h = hidden[s:e]
            logits = _head_logits(h, weight)
            parts = [_part(t, s, e, ctx.fused) for t in (lse, targets, grad_logp)]
            if with_ent:
                grad = _fused("grad_ent", logits) if ctx.fused else _chunk_grad_ent
                ents = [_part(t, s, e, ctx.fused) for t in (ent, grad_ent)]
                g = grad(logits, *parts, *ents, hidden.dtype)
            else:
                grad = _fused("grad", logits) if ctx.fused else _chunk_grad
                g = grad(logits, *parts, hidden.dtype)
            if grad_h is not None:
                grad_h[s:e] = g @ weight
            if grad_w is not None:
                grad_w.add_(_mm_f32(g.t(), h))
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int = 1024,
    with_entropy: bool = False,
    fused: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` under ``softmax(hidden @ weight.T)``, without the ``[N, V]`` float32 logits.

    ``hidden [N, H]`` (the last hidden states of the scored positions), ``weight [V, H]`` (the output
    embedding), ``targets [N]``. Rows are processed ``chunk_tokens`` at a time: one matmul in the compute
    dtype with float32 results, then log-sum-exp, gather and (with ``with_entropy``) the entropy of the
    same chunk; at most one chunk of logits is alive. Backward recomputes each chunk's logits and returns
    gradients to ``hidden`` and ``weight`` (a tied input embedding gets its share through autograd).
    ``chunk_tokens <= 0`` computes all rows at once (the reference: :func:`token_logprobs` of the full
    logits). Returns float32 ``(logprobs [N], entropy [N] or None)``; the entropy carries a gradient only with
    ``entropy_grad`` (an entropy bonus). ``fused`` runs each chunk's statistics and its gradient through
    `torch.compile`d kernels (same math).
    """
    if chunk_tokens <= 0:
        logits = _head_logits(hidden, weight)
        ent = None
        if with_entropy:
            ent = entropy_from_logits(logits) if entropy_grad else entropy_from_logits(logits.detach())
        return token_logprobs(logits, targets), ent
    logp, ent = _ChunkedLogprobs.apply(
        hidden, weight, targets.long(), int(chunk_tokens), with_entropy, fused, entropy_grad
    )
    return logp, (ent if with_entropy else None)
