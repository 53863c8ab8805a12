"""`algorithm.*`: the mode (sync, one_step_off, fully_async), the GRPO loss and its off-policy correction.
`mode` and `correction` are keys of the roles' registries, checked by app/preflight.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from app.config.base import KlKind, LossAgg, OverBound, Range, _Section, require, rng


@dataclass
class AlgorithmConfig(_Section):
    mode: str = "sync"
    """`sync` (generate with version t, train, push), `one_step_off` (generation of t+1 overlaps training) or
    `fully_async` (groups stream into a bounded queue; staleness bounded by `max_staleness`)."""
    max_staleness: float = 1.0
    """fully_async: bound on trained-token staleness in versions (fractions allowed). Admission control
    keeps started groups <= (max_staleness + replica version + 1) x train.batch_groups (AReaL's rule);
    0 behaves as sync, 1 as one_step_off."""
    sync_every: int = 1
    """fully_async: push weights every this many optimizer steps (needs max_staleness >= sync_every - 1)."""
    over_bound: OverBound = "regenerate"
    """A group that still exceeds max_staleness when taken (a straggler): `regenerate` its prompt (so no
    trained token is older than max_staleness versions) or `train` it anyway (with `correction`; staleness
    can then exceed the bound by the pushes made while it generated). Either way it is counted
    (`async/over_bound`); no prompt is lost."""
    correction: str = "none"
    """Off-policy correction: `none` (PPO ratio against the behaviour log-probs), `tis` (clip against the
    trainer's policy, weight by min(pi_prox/pi_behav, is_cap)), `decoupled` (AReaL: same, uncapped)."""
    is_cap: float = 2.0
    """Cap of the truncated importance weight (`correction=tis`)."""
    clip_low: float = 0.2
    """PPO ratio clip below: ratios under 1 - clip_low are clipped."""
    clip_high: float = 0.28
    """PPO ratio clip above (DAPO's clip-higher): ratios over 1 + clip_high are clipped."""
    loss_agg: LossAgg = "token_mean"
    """`token_mean` (every token of the batch weighs the same) or `seq_mean` (every sequence does)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the initial policy (0 disables it and the reference model)."""
    kl_kind: KlKind = "low_var_kl"
    """KL estimator: `k1`, `k3` or `low_var_kl` (k3 clamped, as verl)."""
    normalize_adv_std: bool = True
    """Divide group-centred rewards by the group's standard deviation (GRPO); off gives Dr. GRPO."""
    max_log_ratio: float = 20.0
    """Log-ratios are clamped to +-this before exp()."""
    clip_ratio_c: float | None = None
    """Dual-clip (verl's default 3.0; None: off): with a negative advantage a token's loss is capped at
    clip_ratio_c * |A|, so a huge ratio on a bad token cannot dominate the step."""
    filter_groups: bool = False
    """DAPO's dynamic sampling: a group whose rewards are all equal (no learning signal: every advantage is
    0) is not trained; it is replaced from the prompt stream, so every batch keeps `train.batch_groups`
    groups (the last may have fewer when the data runs out). Counted (`async/filtered_groups`) and logged
    to `filtered_groups.jsonl` beside `trained_groups.jsonl`; works in every mode."""
    ppo_mini_batch_size: int = 0
    """Prompt groups per optimizer step (verl's `ppo_mini_batch_size`, in prompts): each batch of
    `train.batch_groups` groups is split into mini-batches of this many, one optimizer step each; 0: the whole
    batch in one step. With several optimizer steps per batch the trainer first computes its own log-probs of
    the batch (one forward pass without gradient): the clip and the importance weights of `correction=tis`
    and `decoupled` are taken against them, so later mini-batches are clipped against the step's start."""
    ppo_epochs: int = 1
    """Passes over each batch's mini-batches (verl's `ppo_epochs`): optimizer steps per batch =
    ppo_epochs x mini-batches. The batch is still one weight version (one push)."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss minus this times the policy's mean token entropy (aggregated as `loss_agg`);
    0: none. `actor/entropy` is logged whenever it is on."""
    val_every: int = 5
    """Validate every this many versions (and at the first and last)."""
    val_temperature: float = 0.0
    """Sampling temperature at validation (0: greedy)."""

    _RANGES: ClassVar[dict[str, Range]] = {
        "max_staleness": rng(">= 0", "0 behaves as sync; an unbounded queue is not a bound"),
        "sync_every": rng(">= 1"),
        "is_cap": rng(">= 1", "the truncated importance weight is capped at or above 1"),
        "clip_low": rng("[0, 1)", "ratios under 1 - clip_low are clipped"),
        "clip_high": rng(">= 0"),
        "kl_coef": rng(">= 0", "0 disables the KL penalty"),
        "max_log_ratio": rng("> 0", "log-ratios are clamped to +-this before exp()"),
        "clip_ratio_c": rng("> 1", "null turns dual-clip off"),
        "ppo_mini_batch_size": rng(">= 0", "0: the whole batch in one optimizer step"),
        "ppo_epochs": rng(">= 1"),
        "entropy_coef": rng(">= 0", "a negative bonus would push the policy to collapse"),
        "val_every": rng(">= 1"),
        "val_temperature": rng(">= 0", "0: greedy"),
    }

    def check(self, prefix: str) -> None:
        super().check(prefix)
        require(
            f"{prefix}max_staleness",
            self.mode != "fully_async" or self.max_staleness >= self.sync_every - 1,
            f"{self.max_staleness} < {prefix}sync_every - 1 = {self.sync_every - 1}: between pushes the replicas "
            "lag the trainer by up to sync_every - 1 versions; raise max_staleness or push more often",
        )
