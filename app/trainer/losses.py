"""Policy losses, chosen by `algorithm.correction` from the `LOSSES` registry.

A loss takes the tensors of one micro-batch (`LossInputs`) and the algorithm settings, and returns a
`LossOutputs`: the per-token loss and the per-token tensors its metrics come from. `Learner.step` calls
`LOSSES[cfg.algorithm.correction]` and knows nothing else about it; adding a variant is one function and
one registry line (tests/test_losses.py trains a step with a toy one). The math itself lives in app/trainer/grpo.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from app.trainer import grpo


@dataclass(kw_only=True)
class LossInputs:
    """One micro-batch, every tensor ``[B, T]`` aligned with the response tokens."""

    logprobs: torch.Tensor  # the trainer's, with gradient
    behaviour_logprobs: torch.Tensor  # the sampling policy's (from the rollout)
    advantages: torch.Tensor
    mask: torch.Tensor
    # the trainer's own log-probs at the start of the step, when a batch takes several optimizer steps
    # (`algorithm.ppo_mini_batch_size`, `ppo_epochs`); None: one step, the current policy is the step's start
    proximal_logprobs: torch.Tensor | None = None


@dataclass(kw_only=True)
class LossOutputs:
    """Per-token loss (masked positions 0) plus the per-token tensors the step's metrics are built from."""

    loss_tok: torch.Tensor
    clipped: torch.Tensor  # bool: a clip is active (zero gradient) -> actor/clip_frac
    is_weight: torch.Tensor  # importance weight applied to the token -> actor/is_weight_mean/max


LossFn = Callable[[LossInputs, Any], LossOutputs]


def ppo(inp: LossInputs, a: Any) -> LossOutputs:
    """`none`: PPO's clipped surrogate against the behaviour log-probs (no off-policy correction; with several
    optimizer steps per batch the ratio to the behaviour policy also measures how far earlier steps moved)."""
    loss_tok, clipped = grpo.policy_loss(
        inp.logprobs,
        inp.behaviour_logprobs,
        inp.advantages,
        inp.mask,
        a.clip_low,
        a.clip_high,
        a.max_log_ratio,
        a.clip_ratio_c,
    )
    return LossOutputs(loss_tok=loss_tok, clipped=clipped, is_weight=torch.ones_like(inp.logprobs))


def _decoupled(inp: LossInputs, a: Any, cap: float | None) -> LossOutputs:
    # the proximal policy is the trainer's at the step's start: with one optimizer step per batch that is the
    # current one, so its log-probs are this forward's, detached (no extra forward pass)
    prox = inp.logprobs.detach() if inp.proximal_logprobs is None else inp.proximal_logprobs.detach()
    loss_tok, clipped = grpo.decoupled_policy_loss(
        inp.logprobs,
        prox,
        inp.behaviour_logprobs,
        inp.advantages,
        inp.mask,
        a.clip_low,
        a.clip_high,
        cap,
        a.max_log_ratio,
        a.clip_ratio_c,
    )
    w = grpo.tis_weights(prox, inp.behaviour_logprobs, cap, a.max_log_ratio)
    return LossOutputs(loss_tok=loss_tok, clipped=clipped, is_weight=w)


def tis(inp: LossInputs, a: Any) -> LossOutputs:
    """`tis`: clip against the trainer's policy, weight by min(pi_prox / pi_behav, algorithm.is_cap)."""
    return _decoupled(inp, a, a.is_cap)


def decoupled(inp: LossInputs, a: Any) -> LossOutputs:
    """`decoupled` (AReaL): as `tis`, with the importance weight uncapped."""
    return _decoupled(inp, a, None)


LOSSES: dict[str, LossFn] = {"none": ppo, "tis": tis, "decoupled": decoupled}
