"""`builtin:mathproblems`: seeded competition-style problems in MATH's layout, for a real small model.

Each problem is one of MATH's easiest kinds (prealgebra and algebra, levels 1-2): a sum or difference of two
fractions, a linear equation, a percentage, an order-of-operations or exponent expression, a greatest common
divisor, the mean of four numbers. The question is written in LaTeX as MATH writes it ("Compute
$\\frac{1}{4} + \\frac{2}{3}$. Express your answer as a common fraction."), asked as a chat message with the
instruction MATH's evaluators use (reason step by step, the final answer in `\\boxed{}`); the answer is a
short solution ending in `\\boxed{A}`, where A is an integer or a reduced fraction. The data source is
`math_synth`, so `reward.fn=auto` scores it with the math reward: math-verify's equivalence, so `0.5`,
`\\frac{1}{2}` and `\\dfrac{1}{2}` all score.

The splits are disjoint in (kind, numbers): validation measures the skill, not memory.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from math import gcd
from pathlib import Path

from app.tasks.splits import write_splits

BUILD_VERSION = 1  # bump when the generator changes: invalidates the cache
SOURCE = "math_synth"
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class MathProblem:
    uid: str
    problem: str
    solution: str  # MATH layout: the working, then `\boxed{A}`
    answer: str  # A, as LaTeX (an integer or `\frac{p}{q}`)


def latex(q: Fraction) -> str:
    """`q` as MATH writes a final answer: an integer, or `\\frac{p}{q}` in lowest terms (sign in front)."""
    if q.denominator == 1:
        return str(q.numerator)
    sign = "-" if q < 0 else ""
    return f"{sign}\\frac{{{abs(q.numerator)}}}{{{q.denominator}}}"


def _fractions(a: int, b: int, c: int, d: int) -> tuple[str, str, Fraction]:
    op = "+" if (a + b + c + d) % 2 == 0 else "-"
    x, y = Fraction(a, b), Fraction(c, d)
    value = x + y if op == "+" else x - y
    problem = (
        f"Compute $\\frac{{{a}}}{{{b}}} {op} \\frac{{{c}}}{{{d}}}$. Express your answer as a common fraction."
    )
    lcd = b * d // gcd(b, d)
    working = (
        f"The common denominator is ${lcd}$: $\\frac{{{a * lcd // b}}}{{{lcd}}} {op} "
        f"\\frac{{{c * lcd // d}}}{{{lcd}}} = {latex(value)}$."
    )
    return problem, working, value


def _linear(a: int, b: int, c: int, d: int) -> tuple[str, str, Fraction]:
    x = c  # the solution; the right side follows from it
    right = a * x + b
    problem = f"Solve for $x$: ${a}x + {b} = {right}$."
    working = f"Subtract ${b}$: ${a}x = {right - b}$. Divide by ${a}$: $x = {x}$."
    return problem, working, Fraction(x)


def _percent(a: int, b: int, c: int, d: int) -> tuple[str, str, Fraction]:
    p, n = 5 * a, 20 * b  # a multiple of 5 percent of a multiple of 20: a whole number
    value = Fraction(p * n, 100)
    problem = f"What is ${p}\\%$ of ${n}$?"
    working = f"${p}\\%$ of ${n}$ is $\\frac{{{p}}}{{100}} \\cdot {n} = {latex(value)}$."
    return problem, working, value


def _expression(a: int, b: int, c: int, d: int) -> tuple[str, str, Fraction]:
    value = a + b * c - d
    problem = f"Compute ${a} + {b} \\cdot {c} - {d}$."
    working = f"Multiply first: ${b} \\cdot {c} = {b * c}$, so ${a} + {b * c} - {d} = {value}$."
    return problem, working, Fraction(value)


def _powers(a: int, b: int, c: int, d: int) -> tuple[str, str, Fraction]:
    value = a**2 + b**3
    problem = f"Evaluate ${a}^2 + {b}^3$."
    working = f"${a}^2 = {a * a}$ and ${b}^3 = {b**3}$, so the sum is ${value}$."
    return problem, working, Fraction(value)


def _gcd(a: int, b: int, c: int, d: int) -> tuple[str, str, Fraction]:
    x, y = a * c, b * c  # c divides both
    value = gcd(x, y)
    problem = f"What is the greatest common divisor of ${x}$ and ${y}$?"
    working = f"${x} = {value} \\cdot {x // value}$ and ${y} = {value} \\cdot {y // value}$"
    working += ", with no common factor left."
    return problem, working, Fraction(value)


def _mean(a: int, b: int, c: int, d: int) -> tuple[str, str, Fraction]:
    nums = (a, b, c, d)
    value = Fraction(sum(nums), 4)
    problem = (
        f"What is the arithmetic mean of ${a}$, ${b}$, ${c}$ and ${d}$? "
        "Express your answer as a common fraction."
    )
    working = f"The sum is ${sum(nums)}$; divided by $4$ it is ${latex(value)}$."
    return problem, working, value


Kind = Callable[[int, int, int, int], tuple[str, str, Fraction]]
KINDS: tuple[tuple[Kind, tuple[int, int], tuple[int, int], tuple[int, int], tuple[int, int]], ...] = (
    (_fractions, (1, 7), (2, 9), (1, 7), (2, 9)),
    (_linear, (2, 9), (1, 20), (1, 12), (1, 1)),
    (_percent, (1, 19), (1, 10), (1, 1), (1, 1)),
    (_expression, (2, 30), (2, 9), (2, 9), (1, 9)),
    (_powers, (2, 12), (2, 5), (1, 1), (1, 1)),
    (_gcd, (2, 9), (2, 9), (2, 12), (1, 1)),
    (_mean, (1, 20), (1, 20), (1, 20), (1, 20)),
)


def _problem(uid: str, k: int, a: int, b: int, c: int, d: int) -> MathProblem:
    problem, working, value = KINDS[k][0](a, b, c, d)
    answer = latex(value)
    return MathProblem(uid, problem, f"{working} The answer is $\\boxed{{{answer}}}$.", answer)


def _well_posed(k: int, a: int, b: int, c: int, d: int) -> bool:
    """Fractions are given in lowest terms (as MATH gives them), and the gcd problem's answer is `c`."""
    if KINDS[k][0] is _fractions:
        return gcd(a, b) == 1 and gcd(c, d) == 1 and a < b and c < d
    if KINDS[k][0] is _gcd:
        return gcd(a, b) == 1
    return True


def _keys(rng: random.Random) -> list[tuple[int, int, int, int, int]]:
    """Every distinct (kind, numbers), shuffled; kinds with fewer combinations are not crowded out: each kind
    contributes at most 2,000 keys (the mean's 160,000 would otherwise be most of the data)."""
    keys: list[tuple[int, int, int, int, int]] = []
    for k, (_, sa, sb, sc, sd) in enumerate(KINDS):
        mine = [
            (k, a, b, c, d)
            for a in range(sa[0], sa[1] + 1)
            for b in range(sb[0], sb[1] + 1)
            for c in range(sc[0], sc[1] + 1)
            for d in range(sd[0], sd[1] + 1)
            if _well_posed(k, a, b, c, d)
        ]
        rng.shuffle(mine)
        keys.extend(mine[:2000])
    rng.shuffle(keys)
    return keys


def make_math_problems(
    seed: int = 0, n_train: int = 4000, n_val: int = 200
) -> tuple[list[MathProblem], list[MathProblem]]:
    """Disjoint train/val problems (by kind and numbers), deterministic in `seed`."""
    keys = _keys(random.Random(seed))
    if n_train + n_val > len(keys):
        raise ValueError(f"{n_train} + {n_val} math problems asked, {len(keys)} distinct ones exist")
    val = [_problem(f"mp-val-{i}", *key) for i, key in enumerate(keys[:n_val])]
    train = [_problem(f"mp-train-{i}", *key) for i, key in enumerate(keys[n_val : n_val + n_train])]
    return train, val


def row(p: MathProblem, split: str, index: int) -> dict[str, object]:
    """A prompt-file row (chat messages, the final answer as LaTeX), as scripts/prepare_data.py writes
    MATH."""
    return {
        "id": p.uid,
        "prompt": [{"role": "user", "content": f"{p.problem}\n{INSTRUCTION}"}],
        "answer": p.answer,
        "data_source": SOURCE,
        "extra_info": {"split": split, "index": index, "solution": p.solution},
    }


def ensure_math_problems(cache_dir: str | Path, seed: int = 0) -> Path:
    """Write (once) `train.jsonl` and `val.jsonl` of the math problems under `cache_dir`; returns the
    folder."""
    root = Path(cache_dir) / f"mathproblems-v{BUILD_VERSION}-seed{seed}"
    if (root / "val.jsonl").exists():
        return root
    train, val = make_math_problems(seed)
    splits = {"train": train, "val": val}
    return write_splits(root, {s: [row(p, s, i) for i, p in enumerate(ps)] for s, ps in splits.items()})
