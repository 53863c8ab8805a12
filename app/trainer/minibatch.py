"""PPO mini-batches and epochs: how one batch becomes several optimizer steps, and how their metrics become
the step's (pure functions, unit tested).

A batch of `train.batch_groups` groups is split, in order, into mini-batches of `algorithm.ppo_mini_batch_size`
groups (the last may be smaller; 0: the whole batch), and `Learner.step` takes one optimizer step per
mini-batch, `algorithm.ppo_epochs` times over. Groups are never split: GRPO's advantages are per group.
"""

from __future__ import annotations

from dataclasses import replace

from app.records import Batch

# per-token means, combined over the updates weighted by each update's token count
_TOKEN_MEANS = (
    "loss/policy",
    "loss/kl",
    "loss/entropy_bonus",
    "actor/entropy",
    "actor/clip_frac",
    "actor/logprob_mismatch",
    "actor/is_weight_mean",
    "actor/ppo_kl",
)


def mini_batches(batch: Batch, groups: int) -> list[Batch]:
    """`batch` cut into consecutive mini-batches of `groups` groups (0 or more than the batch: the batch
    itself). Each keeps the batch's groups only: the batch-level fields (timings, filtered groups, stream
    metrics) stay with the batch."""
    if groups <= 0 or groups >= len(batch.groups):
        return [batch]
    return [
        replace(batch, groups=batch.groups[i : i + groups], filtered=[], extra={})
        for i in range(0, len(batch.groups), groups)
    ]


def merge_updates(
    updates: list[dict[str, float]], tokens: list[float], batch_tokens: float
) -> dict[str, float]:
    """The step's metrics from its updates' (one dict per optimizer step, `tokens[i]` the loss tokens of
    update i): per-token means weighted by tokens, the gradient norm averaged (`actor/grad_norm_max` too
    with several), the importance-weight max the largest, the learning rate the last, skipped updates
    counted, `train/tokens` the batch's (`batch_tokens`: each token once, however many epochs) and
    `actor/optimizer_steps` the optimizer steps taken."""
    skipped = sum(u["train/skipped_steps"] for u in updates)
    steps = {"train/tokens": batch_tokens, "actor/optimizer_steps": len(updates) - skipped}
    if len(updates) == 1:
        return {**updates[0], **steps}
    total = max(1.0, sum(tokens))
    out = {**updates[-1], **steps, "train/skipped_steps": skipped}
    for key in _TOKEN_MEANS:
        if key in out:
            out[key] = sum(u[key] * n for u, n in zip(updates, tokens, strict=True)) / total
    norms = [u["actor/grad_norm"] for u in updates]
    out["actor/grad_norm"] = sum(norms) / len(norms)
    out["actor/grad_norm_max"] = max(norms)
    out["actor/is_weight_max"] = max(u["actor/is_weight_max"] for u in updates)
    return out
