"""`builtin:mathproblems`: seeded, disjoint splits in MATH's layout whose reference solutions the math reward
scores 1.0, with answers written as MATH writes them."""

from __future__ import annotations

import json
from fractions import Fraction

from app.rewards import math_reward, resolve_reward_fn
from app.tasks.mathproblems import (
    INSTRUCTION,
    SOURCE,
    _fractions,
    _linear,
    ensure_math_problems,
    latex,
    make_math_problems,
)


def test_latex_writes_integers_and_reduced_fractions():
    assert latex(Fraction(6, 3)) == "2"
    assert latex(Fraction(6, 4)) == "\\frac{3}{2}"
    assert latex(Fraction(-1, 6)) == "-\\frac{1}{6}"


def test_kinds_compute_by_hand():
    problem, _, value = _fractions(1, 4, 2, 3)  # 1+4+2+3 is even: a sum
    assert problem.startswith("Compute $\\frac{1}{4} + \\frac{2}{3}$") and value == Fraction(11, 12)
    problem, _, value = _fractions(1, 2, 1, 3)  # odd: a difference
    assert "\\frac{1}{2} - \\frac{1}{3}" in problem and value == Fraction(1, 6)
    problem, working, value = _linear(3, 4, 9, 1)
    assert problem == "Solve for $x$: $3x + 4 = 31$." and value == 9 and "$3x = 27$" in working


def test_splits_are_seeded_disjoint_and_their_solutions_score_one():
    train, val = make_math_problems(seed=0)
    assert (len(train), len(val)) == (4000, 200)
    assert make_math_problems(seed=0)[1] == val and make_math_problems(seed=1)[1] != val
    assert not {p.problem for p in train} & {p.problem for p in val}
    assert all(math_reward(p.solution, p.answer) == 1.0 for p in val)
    wrong = val[0].solution.replace(f"\\boxed{{{val[0].answer}}}", "\\boxed{-99}")
    assert math_reward(wrong, val[0].answer) == 0.0


def test_rows_are_chat_prompts_routed_to_the_math_reward(tmp_path):
    root = ensure_math_problems(tmp_path, seed=0)
    rows = [json.loads(line) for line in (root / "val.jsonl").read_text().splitlines()]
    assert len(rows) == 200 and rows[0]["id"] == "mp-val-0" and rows[0]["data_source"] == SOURCE
    assert rows[0]["prompt"][0]["role"] == "user" and rows[0]["prompt"][0]["content"].endswith(INSTRUCTION)
    assert resolve_reward_fn("auto", SOURCE) is math_reward
    first = json.loads((root / "train.jsonl").read_text().splitlines()[0])
    assert first["id"] == "mp-train-0" and first["extra_info"]["split"] == "train"
    assert ensure_math_problems(tmp_path, seed=0) == root  # built once


def test_math_shaped_gives_the_box_the_answer_and_the_format_their_credit():
    from app.rewards import last_boxed, math_shaped_reward

    assert last_boxed("so $\\boxed{\\frac{1}{2}}$, and \\boxed{x") is None  # the last box is open
    assert last_boxed("$\\boxed{3}$ then $\\boxed{\\frac{1}{2}}$.") == "\\frac{1}{2}"
    half = "\\frac{1}{2}"
    cases = {
        "The answer is $\\boxed{\\frac{1}{2}}$.": (1.0, 1, 1, 1),
        "The answer is $\\boxed{0.5}$.": (1.0, 1, 1, 1),
        "The answer is 0.5": (0.8, 0, 1, 0),
        "The answer is $\\boxed{3}$.": (0.1, 0, 0, 1),
        "I do not know.": (0.0, 0, 0, 0),
    }
    for response, (score, strict, flexible, formatted) in cases.items():
        got = math_shaped_reward(response, half)
        assert got == {"score": score, "strict": strict, "flexible": flexible, "formatted": formatted}, (
            response
        )
    assert resolve_reward_fn("math_shaped") is math_shaped_reward


def test_a_tiny_model_is_refused_the_math_task_naming_the_preset():
    import pytest

    from app.config import ConfigError
    from app.preflight import load_config  # a run's load: the config checked against the built-ins

    with pytest.raises(ConfigError, match=r"builtin:mathproblems needs a real tokenizer.*--config math"):
        load_config(None, ["data.train=builtin:mathproblems", "data.val=builtin:mathproblems"])
