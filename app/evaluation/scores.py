"""mean@n and pass@k per `data_source`: the one scoring of validation (during training) and `python -m app eval`.

Each prompt has n scored samples. Per source, over its prompts:

    mean@n   the mean reward of all n samples of a prompt, averaged over the prompts (the reward's expectation)
    pass@k   the chance that at least one of k samples drawn (without replacement) from the prompt's n passes,
             averaged over the prompts; a sample passes when its reward >= the pass threshold. With c of n
             passing, the unbiased estimator (Chen et al. 2021, Codex) is 1 - C(n-c, k) / C(n, k).

`all` holds the same over every prompt of every source, each under its MLflow-safe name (`mean_at_4`,
`pass_at_1`: MLflow refuses `@`), in the RESULT record, scores.json and the tracker alike. Pure Python: no
torch, Ray or vLLM.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ALL = "all"  # the key of the scores over every source together
MEAN, PASS = "mean_at_", "pass_at_"  # mean@n as `mean_at_<n>`, pass@k as `pass_at_<k>`


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k): the chance that k of n samples (c of them passing), drawn without replacement,
    hold at least one that passes."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k holds a passing sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass(frozen=True)
class PromptRewards:
    """One prompt's samples: its data source and each sample's reward."""

    data_source: str
    rewards: Sequence[float]


def mean_key(n: int) -> str:
    return f"{MEAN}{n}"


def pass_key(k: int) -> str:
    return f"{PASS}{k}"


def score(
    prompts: Iterable[PromptRewards], ks: Sequence[int], threshold: float
) -> dict[str, dict[str, float]]:
    """{source: {"mean_at_<n>": ..., "pass_at_<k>": ... for each k, "prompts": count}} plus the same under
    `all`.
    Every prompt must have the same number n of samples, and every k must be in [1, n]."""
    by_source: dict[str, list[PromptRewards]] = defaultdict(list)
    n = None
    for p in prompts:
        if n is None:
            n = len(p.rewards)
        if len(p.rewards) != n or n == 0:
            raise ValueError(
                f"every prompt needs the same number of samples (> 0); got {len(p.rewards)} and {n}"
            )
        by_source[p.data_source].append(p)
    if n is None:
        return {}
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(f"pass@k needs 1 <= k <= n = {n} samples per prompt; got k = {bad}")
    groups = {src: by_source[src] for src in sorted(by_source)}
    groups[ALL] = [p for ps in groups.values() for p in ps]
    return {src: _summary(ps, n, ks, threshold) for src, ps in groups.items()}


def _summary(prompts: list[PromptRewards], n: int, ks: Sequence[int], threshold: float) -> dict[str, float]:
    out = {mean_key(n): sum(sum(p.rewards) / n for p in prompts) / len(prompts)}
    for k in ks:
        out[pass_key(k)] = sum(pass_at_k(n, _passed(p, threshold), k) for p in prompts) / len(prompts)
    out["prompts"] = float(len(prompts))
    return out


def _passed(p: PromptRewards, threshold: float) -> int:
    return sum(1 for r in p.rewards if r >= threshold)


def metric_items(scores: dict[str, dict[str, float]], prefix: str) -> dict[str, float]:
    """Flat metric names for a tracker: `{prefix}/{source}/mean_at_4`, `{prefix}/{source}/pass_at_1`: the
    names of `score`'s record (other characters MLflow refuses, in a source's name, are replaced by the
    tracker)."""
    return {
        f"{prefix}/{src}/{name}": value
        for src, values in scores.items()
        for name, value in values.items()
        if name != "prompts"
    }


def ks_for(ks: Sequence[int], n: int) -> list[int]:
    """The k of `ks` that n samples per prompt can estimate (k <= n), sorted, without repeats."""
    return sorted({k for k in ks if 1 <= k <= n})


def sub_score_means(extras: Iterable[dict[str, float]], prefix: str = "") -> dict[str, float]:
    """The mean of each named sub-score over the samples that report it (a reward's dict extras, e.g. the
    `gsm8k_shaped` reward's `strict` and `flexible`), keyed `prefix + name`."""
    sums: dict[str, list[float]] = defaultdict(list)
    for ex in extras:
        for k, v in ex.items():
            sums[k].append(float(v))
    return {f"{prefix}{k}": sum(v) / len(v) for k, v in sorted(sums.items())}


def per_prompt(
    prompts: Iterable[tuple[str, Sequence[float]]], ks: Sequence[int], threshold: float
) -> dict[str, dict[str, float]]:
    """{uid: {"passed": c, "n": n, "pass_at_<k>": ... for each k <= n}} for each prompt's sample rewards: which
    problems a model solves (HumanEval's per-problem pass@k), beside `score`'s means over them."""
    out: dict[str, dict[str, float]] = {}
    for uid, rewards in prompts:
        n, c = len(rewards), sum(1 for r in rewards if r >= threshold)
        row: dict[str, float] = {"passed": float(c), "n": float(n)}
        row.update({pass_key(k): pass_at_k(n, c, k) for k in ks if 1 <= k <= n})
        out[uid] = row
    return out
