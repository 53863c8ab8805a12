"""`builtin:wordproblems`: seeded arithmetic word problems in GSM8K's layout, for a real small model.

Each problem is one step (a little over half of them: sums and differences of two-digit numbers, small products and
quotients) or two steps of whole-number arithmetic in a short story ("Mia has 7 boxes with 6 pens in
each box. How many pens does Mia have?"), asked as a chat message with GSM8K's instruction (think step by step,
final answer after "####"); the answer is a GSM8K solution ending in `#### N`. The data source is
`gsm8k_synth`, so `reward.fn=auto` scores it with the GSM8K reward, and `reward.fn=gsm8k_shaped` adds the
flexible match and the format bonus a small model needs (app/rewards/__init__.py).

The splits are disjoint in (template, numbers): validation measures the skill, not memory. SmolLM2-135M-Instruct
gets a minority of them right and rarely writes the `#### N` form (docs/benchmarks.md): it starts weak and can
learn.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from app.tasks.splits import write_splits

BUILD_VERSION = 2  # bump when the generator changes: invalidates the cache
SOURCE = "gsm8k_synth"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
NAMES = ("Mia", "Noah", "Ava", "Liam", "Zoe", "Omar", "Lena", "Ravi", "Sara", "Tom", "Yuki", "Ben")
ITEMS = ("apples", "pencils", "marbles", "stickers", "cookies", "books", "shells", "cards", "coins", "eggs")


Span = tuple[int, int]  # inclusive range of a number
ONE = (1, 1)  # a number the template does not use


@dataclass(frozen=True)
class Template:
    """A story with numbers a, b, c drawn from their spans: `question` and `steps` are format strings (`p` is
    a * b, `s` is a + b, `n` the answer), `answer` computes N."""

    question: str
    steps: str
    answer: Callable[[int, int, int], int]
    a: Span
    b: Span
    c: Span = ONE


TEMPLATES: tuple[Template, ...] = (
    Template(
        "{name} has {a} boxes with {b} {item} in each box. How many {item} does {name} have?",
        "{a} boxes x {b} {item} = {n} {item}.",
        lambda a, b, c: a * b,
        (2, 12),
        (2, 12),
    ),
    Template(
        "{name} had {a} {item} and found {b} more. How many {item} does {name} have now?",
        "{a} + {b} = {n}.",
        lambda a, b, c: a + b,
        (5, 60),
        (2, 40),
    ),
    Template(
        "{name} had {s} {item} and gave {b} of them away. How many {item} are left?",
        "{s} - {b} = {n}.",
        lambda a, b, c: a,
        (2, 50),
        (2, 30),
    ),
    Template(
        "{name} shares {p} {item} equally among {b} friends. How many {item} does each friend get?",
        "{p} / {b} = {n}.",
        lambda a, b, c: a,
        (2, 12),
        (2, 10),
    ),
    Template(
        "A bag holds {a} {item}. {name} fills {b} bags and then gives away {c} {item}. "
        "How many {item} does {name} keep?",
        "{b} bags x {a} = {p} {item}; {p} - {c} = {n}.",
        lambda a, b, c: a * b - c,
        (2, 9),
        (2, 9),
        (1, 9),
    ),
    Template(
        "{name} reads {a} pages a day for {b} days, then {c} more pages. How many pages does {name} read?",
        "{a} x {b} = {p} pages; {p} + {c} = {n}.",
        lambda a, b, c: a * b + c,
        (2, 9),
        (2, 9),
        (1, 9),
    ),
    Template(
        "{name} earns {a} dollars an hour and works {b} hours, then spends {c} dollars. "
        "How many dollars does {name} have left?",
        "{a} x {b} = {p} dollars; {p} - {c} = {n}.",
        lambda a, b, c: a * b - c,
        (2, 9),
        (2, 9),
        (1, 9),
    ),
    Template(
        "There are {a} rows with {b} chairs in each row, and {c} chairs are taken. How many chairs are free?",
        "{a} x {b} = {p} chairs; {p} - {c} = {n}.",
        lambda a, b, c: a * b - c,
        (2, 9),
        (2, 9),
        (1, 9),
    ),
)


@dataclass(frozen=True)
class WordProblem:
    uid: str
    question: str
    solution: str  # GSM8K layout: the steps, then `#### N`
    answer: int


def _problem(uid: str, k: int, a: int, b: int, c: int, rng: random.Random) -> WordProblem:
    t = TEMPLATES[k]
    n = t.answer(a, b, c)
    fields = {"a": a, "b": b, "c": c, "p": a * b, "s": a + b, "n": n}
    fields.update(name=rng.choice(NAMES), item=rng.choice(ITEMS))
    return WordProblem(uid, t.question.format(**fields), f"{t.steps.format(**fields)}\n#### {n}", n)


def make_word_problems(
    seed: int = 0, n_train: int = 4000, n_val: int = 200
) -> tuple[list[WordProblem], list[WordProblem]]:
    """Disjoint train/val problems (by template and numbers), deterministic in `seed`; every answer >= 0."""
    rng = random.Random(seed)
    keys = [
        (k, a, b, c)
        for k, t in enumerate(TEMPLATES)
        for a in range(t.a[0], t.a[1] + 1)
        for b in range(t.b[0], t.b[1] + 1)
        for c in range(t.c[0], t.c[1] + 1)
        if c < a * b
    ]
    rng.shuffle(keys)
    if n_train + n_val > len(keys):
        raise ValueError(f"{n_train} + {n_val} word problems asked, {len(keys)} distinct ones exist")
    val = [_problem(f"wp-val-{i}", *key, rng) for i, key in enumerate(keys[:n_val])]
    train = [_problem(f"wp-train-{i}", *key, rng) for i, key in enumerate(keys[n_val : n_val + n_train])]
    return train, val


def row(p: WordProblem, split: str, index: int) -> dict[str, object]:
    """A prompt-file row (chat messages, the GSM8K solution as the answer), as scripts/prepare_data.py writes."""
    return {
        "id": p.uid,
        "prompt": [{"role": "user", "content": f"{p.question} {INSTRUCTION}"}],
        "answer": p.solution,
        "data_source": SOURCE,
        "extra_info": {"split": split, "index": index},
    }


def ensure_word_problems(cache_dir: str | Path, seed: int = 0) -> Path:
    """Write (once) `train.jsonl` and `val.jsonl` of the word problems under `cache_dir`; returns the folder."""
    root = Path(cache_dir) / f"wordproblems-v{BUILD_VERSION}-seed{seed}"
    if (root / "val.jsonl").exists():
        return root
    train, val = make_word_problems(seed)
    splits = {"train": train, "val": val}
    return write_splits(root, {s: [row(p, s, i) for i, p in enumerate(ps)] for s, ps in splits.items()})
