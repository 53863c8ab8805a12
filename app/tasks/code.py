"""The built-in code task `builtin:code`: tiny stdin/stdout programming problems, scored by running code.

Each problem is a small parameterised family ("read two integers a and b, print 3*a - 2*b", "print the
largest of a list", "reverse a string", ...) with one worked example in the prompt and three hidden
tests in the answer, a JSON string `{"tests": [{"input": ..., "output": ...}, ...]}` that
`app.rewards.code.code_reward` understands. Everything is generated locally and deterministically from a seed;
prompts are unique. Every problem carries a reference solution, used by the tests only (it is not written
to the task files) to prove that its tests are solvable.
"""

from __future__ import annotations

import json
import logging
import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from app.tasks.splits import write_splits

log = logging.getLogger(__name__)

DATA_SOURCE = "code"
TASK_VERSION = 1  # bump when the generator changes: invalidates cached task files
N_TESTS = 3
INSTRUCTIONS = (
    "Write a Python 3 program that reads from standard input and writes to standard output. "
    "Reply with the program in a ```python code block."
)


@dataclass(frozen=True)
class CodeProblem:
    """One problem: the prompt, its hidden tests and a reference solution (never shown to the model)."""

    uid: str
    family: str  # the generator's name, e.g. "linear", "sort"
    prompt: str
    tests: tuple[tuple[str, str], ...]  # (stdin, expected stdout)
    solution: str

    def answer(self) -> str:
        """The `answer` field of the row: the tests as JSON, for `code_reward`."""
        return json.dumps({"tests": [{"input": i, "output": o} for i, o in self.tests]})


@dataclass(frozen=True)
class _Spec:
    """A concrete problem before examples: its statement, an input generator, a solver, a solution."""

    statement: str
    make_input: Callable[[random.Random], str]
    solve: Callable[[str], str]
    solution: str


def _ints(rng: random.Random, lo: int = -50, hi: int = 50, n_lo: int = 3, n_hi: int = 8) -> str:
    return " ".join(str(rng.randint(lo, hi)) for _ in range(rng.randint(n_lo, n_hi))) + "\n"


def _word(rng: random.Random, lo: int = 3, hi: int = 10) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(lo, hi)))


def _linear(rng: random.Random) -> _Spec:
    p, q = rng.choice([x for x in range(-5, 6) if x]), rng.randint(-5, 5)
    return _Spec(
        f"Read two integers a and b (on one line, separated by a space) and print {p}*a + {q}*b.",
        lambda r: f"{r.randint(-100, 100)} {r.randint(-100, 100)}\n",
        lambda s: str(p * int(s.split()[0]) + q * int(s.split()[1])),
        f"a, b = map(int, input().split())\nprint({p} * a + {q} * b)\n",
    )


def _add_k(rng: random.Random) -> _Spec:
    k = rng.choice([x for x in range(-99, 100) if x])
    return _Spec(
        f"Read an integer n and print n + {k}.",
        lambda r: f"{r.randint(-1000, 1000)}\n",
        lambda s: str(int(s) + k),
        f"print(int(input()) + {k})\n",
    )


def _extreme(rng: random.Random) -> _Spec:
    largest = rng.random() < 0.5
    word, fn = ("largest", max) if largest else ("smallest", min)
    return _Spec(
        f"Read one line of space-separated integers and print the {word} of them.",
        _ints,
        lambda s: str(fn(map(int, s.split()))),
        f"print({fn.__name__}(map(int, input().split())))\n",
    )


def _sum_mod(rng: random.Random) -> _Spec:
    m = rng.randint(2, 97)
    return _Spec(
        f"Read one line of space-separated integers and print their sum modulo {m} (a number from 0 to {m - 1}).",
        lambda r: _ints(r, -1000, 1000),
        lambda s: str(sum(map(int, s.split())) % m),
        f"print(sum(map(int, input().split())) % {m})\n",
    )


def _sort(rng: random.Random) -> _Spec:
    desc = rng.random() < 0.5
    order = "descending" if desc else "ascending"
    return _Spec(
        f"Read one line of space-separated integers and print them in {order} order, separated by spaces.",
        _ints,
        lambda s: " ".join(map(str, sorted(map(int, s.split()), reverse=desc))),
        f"print(*sorted(map(int, input().split()), reverse={desc}))\n",
    )


def _reverse(rng: random.Random) -> _Spec:
    upper = rng.random() < 0.5
    extra = " in upper case" if upper else ""
    call = ".upper()" if upper else ""
    return _Spec(
        f"Read a word of lowercase letters and print it reversed{extra}.",
        lambda r: _word(r) + "\n",
        lambda s: s.strip()[::-1].upper() if upper else s.strip()[::-1],
        f"print(input().strip()[::-1]{call})\n",
    )


def _count_letter(rng: random.Random) -> _Spec:
    c = rng.choice("aeiou")
    return _Spec(
        f"Read a word of lowercase letters and print how many times the letter '{c}' occurs in it.",
        lambda r: "".join(r.choice(c * 3 + "aeiou" + "bcdlmnrst") for _ in range(r.randint(5, 15))) + "\n",
        lambda s: str(s.strip().count(c)),
        f"print(input().strip().count({c!r}))\n",
    )


def _divisible(rng: random.Random) -> _Spec:
    d = rng.randint(2, 13)
    return _Spec(
        f"Read an integer n and print yes if n is divisible by {d}, otherwise print no.",
        lambda r: f"{r.randint(0, 50) * d + (r.randint(1, d - 1) if r.random() < 0.5 else 0)}\n",
        lambda s: "yes" if int(s) % d == 0 else "no",
        f'print("yes" if int(input()) % {d} == 0 else "no")\n',
    )


def _repeat(rng: random.Random) -> _Spec:
    k, sep = rng.randint(2, 5), rng.choice([" ", "-", ","])
    return _Spec(
        f"Read a word and print it {k} times, separated by {sep!r}.",
        lambda r: _word(r, 2, 6) + "\n",
        lambda s: sep.join([s.strip()] * k),
        f"print({sep!r}.join([input().strip()] * {k}))\n",
    )


FAMILIES: tuple[Callable[[random.Random], _Spec], ...] = (
    _linear,
    _add_k,
    _extreme,
    _sum_mod,
    _sort,
    _reverse,
    _count_letter,
    _divisible,
    _repeat,
)


def _format_prompt(statement: str, example_in: str, example_out: str) -> str:
    return (
        f"{INSTRUCTIONS}\n\nTask: {statement}\n\n"
        f"Example input:\n{example_in.rstrip()}\nExample output:\n{example_out}\n"
    )


def _cases(spec: _Spec, rng: random.Random) -> list[tuple[str, str]]:
    """N_TESTS + 1 distinct (input, output) cases whose hidden outputs are not all equal (so that no
    constant program passes every test). The first one is the prompt's example."""
    for _ in range(100):
        cases: list[tuple[str, str]] = []
        while len(cases) < N_TESTS + 1:
            stdin = spec.make_input(rng)
            if all(stdin != c[0] for c in cases):
                cases.append((stdin, spec.solve(stdin)))
        if len({out for _, out in cases[1:]}) > 1:
            return cases
    raise ValueError(f"cannot make distinct test outputs for {spec.statement!r}")


def _instance(rng: random.Random, uid: str) -> CodeProblem:
    family = rng.choice(FAMILIES)
    spec = family(rng)
    cases = _cases(spec, rng)
    prompt = _format_prompt(spec.statement, *cases[0])
    return CodeProblem(uid, family.__name__.lstrip("_"), prompt, tuple(cases[1:]), spec.solution)


def make_code_problems(n: int, seed: int, prefix: str = "code") -> list[CodeProblem]:
    """`n` problems with unique prompts, deterministic in `seed`; ids are `{prefix}-{i}`."""
    rng = random.Random(seed)
    out: list[CodeProblem] = []
    seen: set[str] = set()
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 20 * n + 100:
            raise ValueError(f"cannot generate {n} distinct code problems (got {len(out)})")
        p = _instance(rng, f"{prefix}-{len(out)}")
        if p.prompt not in seen:
            seen.add(p.prompt)
            out.append(p)
    return out


def _row(p: CodeProblem) -> dict:
    return {"id": p.uid, "prompt": p.prompt, "answer": p.answer(), "data_source": DATA_SOURCE}


def make_code_rows(n: int, seed: int) -> list[dict]:
    """`n` rows `{"id", "prompt", "answer", "data_source": "code"}` (the jsonl format of app.rollout.prompt_files)."""
    return [_row(p) for p in make_code_problems(n, seed)]


def write_code_task(dir: Path, n_train: int, n_val: int, seed: int) -> Path:
    """Write `train.jsonl` and `val.jsonl` (disjoint prompts) under `dir`; returns `dir`."""
    problems = make_code_problems(n_train + n_val, seed)
    splits = {"train": problems[:n_train], "val": problems[n_train:]}
    rows = {s: [_row(p) | {"id": f"code-{s}-{i}"} for i, p in enumerate(ps)] for s, ps in splits.items()}
    root = write_splits(dir, rows)
    log.info("wrote builtin:code task (%d train, %d val) under %s", n_train, n_val, root)
    return root


def ensure_code_task(cache_dir: str | Path, seed: int = 0, n_train: int = 4096, n_val: int = 256) -> Path:
    """The `builtin:code` task folder (`train.jsonl`, `val.jsonl`), written once under `cache_dir`."""
    root = Path(cache_dir) / f"code-v{TASK_VERSION}-seed{seed}-{n_train}-{n_val}"
    if not ((root / "train.jsonl").exists() and (root / "val.jsonl").exists()):
        write_code_task(root, n_train, n_val, seed)
    return root
