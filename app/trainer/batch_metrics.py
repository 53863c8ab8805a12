"""The metrics of a trained batch itself (pure functions of a `Batch`; no torch): rewards, response lengths,
group outcomes, and the staleness of its tokens against the trainer's version."""

from __future__ import annotations

from app.records import Batch
from app.rollout.episode import env_metrics


def staleness(batch: Batch, version: int) -> dict[str, float]:
    """Per-token staleness (the trainer's version minus the version that sampled the token), its mean by
    response-length decile (`staleness/len_decile_0` holds the shortest tenth), and how many groups span
    more than one version (partial rollouts)."""
    vals = [version - v for g in batch.groups for s in g.samples for v in s.versions]
    if not vals:
        return {"staleness/mean": 0.0, "staleness/max": 0.0}
    out = {"staleness/mean": sum(vals) / len(vals), "staleness/max": float(max(vals))}
    samples = [s for g in batch.groups for s in g.samples if s.versions]
    for i, m in enumerate(staleness_by_length_decile(samples, version)):
        out[f"staleness/len_decile_{i}"] = m
    spans = [g.max_version - g.min_version for g in batch.groups if g.samples]
    out["async/partial_ratio"] = sum(1 for x in spans if x > 0) / max(1, len(spans))
    out["async/max_version_span"] = float(max(spans, default=0))
    return out


def staleness_by_length_decile(samples: list, version: int) -> list[float]:
    """Mean per-token staleness of the samples in each response-length decile (shortest first).

    Samples are sorted by length and cut into ten equal-count slices (fewer when there are under ten
    samples); a slice's value is the mean over its tokens.
    """
    ordered = sorted(samples, key=lambda s: len(s.token_ids))
    n = len(ordered)
    k = min(10, n)
    out = []
    for i in range(k):
        part = ordered[i * n // k : (i + 1) * n // k]
        toks = [version - v for s in part for v in s.versions]
        out.append(sum(toks) / len(toks) if toks else 0.0)
    return out


def batch_metrics(batch: Batch) -> dict[str, float]:
    rewards = [s.reward for g in batch.groups for s in g.samples]
    lengths = [len(s.token_ids) for g in batch.groups for s in g.samples]
    n = max(1, len(rewards))
    mean = sum(rewards) / n
    std = (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5
    subs: dict[str, list[float]] = {}
    fns: dict[str, list[float]] = {}  # each reward function's score (reward.fns)
    for g in batch.groups:
        for s in g.samples:
            for k, v in s.reward_extras.items():
                subs.setdefault(k, []).append(v)
            for k, v in s.reward_scores.items():
                fns.setdefault(k, []).append(v)
    solved = sum(1 for g in batch.groups if all(s.reward > 0 for s in g.samples))
    zero = sum(1 for g in batch.groups if len({s.reward for s in g.samples}) == 1)
    return {
        "reward/mean": mean,
        "reward/std": std,
        "response/length_mean": sum(lengths) / n,
        "response/length_max": float(max(lengths, default=0)),
        "response/truncated_frac": sum(
            1 for g in batch.groups for s in g.samples if s.finish_reason == "length"
        )
        / n,
        "batch/groups_all_solved": float(solved),
        "batch/groups_zero_adv": float(zero),
        "data/dropped_overlong": float(batch.dropped_overlong),
        **{k: float(v) for k, v in batch.reward_errors.items()},
        **{f"reward/sub/{k}": sum(v) / len(v) for k, v in subs.items()},  # a reward's named sub-scores
        **{f"reward/{k}": sum(v) / len(v) for k, v in fns.items()},  # each function's of reward.fns
        **env_metrics([s for g in batch.groups for s in g.samples]),
    }
