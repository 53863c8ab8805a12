"""Reward functions in TRL's and verl's own terms (tests/test_rewards_columns.py), selected by dotted path:
the scoring processes import this module, so it imports nothing heavy."""

from __future__ import annotations

from typing import Any


def _text(completion: Any) -> str:
    return completion[0]["content"] if isinstance(completion, list) else completion


def accuracy_reward(completions: list, solution: list, **kwargs: Any) -> list[float | None]:
    """TRL's accuracy_reward signature: the data's `solution` column by its name, and another column,
    `points`, read by name from **kwargs (TRL passes every column). None: no gold answer to check against."""
    return [
        None if not sol else float(_text(c).strip() == sol) * pts
        for c, sol, pts in zip(completions, solution, kwargs["points"], strict=True)
    ]


def needs_tests(completions: list, tests: list, **kwargs: Any) -> list[float]:
    """A TRL-style reward reading a `tests` column that the data may not have."""
    return [float(len(t)) for t in tests]


def rank_by_length(completions: list, **kwargs: Any) -> list[float]:
    """A group-aware reward: each completion's rank by length among the completions it is given (0: the
    shortest), plus 10 x the number of completions given, so a test sees both the group size and the ranks."""
    texts = [_text(c) for c in completions]
    order = sorted(range(len(texts)), key=lambda i: (len(texts[i]), i))
    ranks = {i: r for r, i in enumerate(order)}
    return [10.0 * len(texts) + ranks[i] for i in range(len(texts))]


def verl_any_of(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> dict:
    """verl's compute_score with a list ground truth: right when the response is any of its answers; the
    ground truth's type and length as sub-scores, to show it arrives unchanged."""
    return {
        "score": float(solution_str.strip() in ground_truth),
        "is_list": float(isinstance(ground_truth, list)),
        "answers": float(len(ground_truth)),
    }


def plain_with_columns(completion: str, solution: str, **kwargs: Any) -> dict:
    """Relay's plain style whose positional parameters are named like columns: `solution` is the answer
    (positionally), never passed again as a column; the other columns arrive through **kwargs."""
    return {"score": float(completion == solution), "points": float(kwargs.get("points", -1.0))}
