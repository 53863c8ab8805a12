"""A toy policy loss for tests/test_losses.py: REINFORCE (`-A * logp`) with a constant importance weight,
so a test can tell from the step's metrics that this loss, and no other, ran."""

from __future__ import annotations

from typing import Any

import torch

from app.trainer.losses import LossInputs, LossOutputs

WEIGHT = 0.5


def reinforce(inp: LossInputs, a: Any) -> LossOutputs:
    m = inp.mask.bool()
    loss = torch.where(m, -inp.advantages * inp.logprobs * WEIGHT, torch.zeros_like(inp.logprobs))
    return LossOutputs(
        loss_tok=loss, clipped=torch.zeros_like(m), is_weight=torch.full_like(inp.logprobs, WEIGHT)
    )
