"""Tests for app.tasks.code: the built-in code task is deterministic, unique, solvable and not trivial."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from app.rewards.code import CODE_LIMITS, code_reward
from app.rollout.prompt_files import load_rows
from app.tasks import code as code_task
from app.tasks.code import ensure_code_task, make_code_problems, make_code_rows, write_code_task

SEED = 3


def test_rows_are_deterministic_in_the_seed():
    assert make_code_rows(40, SEED) == make_code_rows(40, SEED)
    assert make_code_rows(40, SEED) != make_code_rows(40, SEED + 1)


def test_rows_have_the_loader_fields_unique_prompts_and_three_tests():
    rows = make_code_rows(300, SEED)
    assert len({r["prompt"] for r in rows}) == len(rows) == 300
    assert len({r["id"] for r in rows}) == 300
    for r in rows:
        assert set(r) == {"id", "prompt", "answer", "data_source"} and r["data_source"] == "code"
        tests = json.loads(r["answer"])["tests"]
        assert len(tests) == code_task.N_TESTS
        assert len({t["output"] for t in tests}) > 1  # no constant program passes
        assert "```python" in r["prompt"] and "Example input:" in r["prompt"]


def test_every_family_appears():
    problems = make_code_problems(200, SEED)
    assert {p.family for p in problems} == {f.__name__.lstrip("_") for f in code_task.FAMILIES}
    statements = " ".join(p.prompt for p in problems)
    for phrase in ["print n +", "largest", "smallest", "modulo", "reversed", "occurs", "divisible", "times"]:
        assert phrase in statements, phrase


def _scores(problem: code_task.CodeProblem) -> tuple[float, float, float]:
    """(reference, constant, neighbour's solution) scores of one problem (generous wall clock: the
    machine running the tests may be loaded, and a spurious timeout is not what is tested here)."""

    def score(response: str) -> dict:
        return code_reward(response, problem.answer(), limits=LIMITS, budget_s=60.0)

    reference = score(f"Here is my solution:\n```python\n{problem.solution}```\n")
    constant = score(f"print({problem.tests[0][1]!r})")  # right on one test at most
    neighbour = score(OTHER_SOLUTION)
    assert reference == {"score": 1.0, "passed": 3, "total": 3}, (problem, reference)
    return reference["score"], constant["score"], neighbour["score"]


OTHER_SOLUTION = "print(input()[::-1] * 2)"
LIMITS = replace(CODE_LIMITS, wall_s=15.0)


def test_reference_solutions_score_one_and_wrong_ones_less():
    first_of_family = {p.family: p for p in reversed(make_code_problems(200, SEED))}
    problems = list(first_of_family.values()) + make_code_problems(6, SEED + 1)
    with ThreadPoolExecutor(4) as pool:  # run_program is thread-safe; the machine may have 2 cores
        scores = list(pool.map(_scores, problems))
    for p, (ref, constant, neighbour) in zip(problems, scores):
        assert ref == 1.0 and constant < 1.0 and neighbour < 1.0, p


def test_written_task_loads_with_disjoint_splits(tmp_path):
    root = write_code_task(tmp_path / "code", n_train=50, n_val=10, seed=SEED)
    train, val = load_rows(str(root / "train.jsonl")), load_rows(str(root / "val.jsonl"))
    assert (len(train), len(val)) == (50, 10)
    assert not {r.prompt for r in train} & {r.prompt for r in val}
    assert {r.data_source for r in train + val} == {"code"}
    assert train[0].uid == "code-train-0" and val[0].uid == "code-val-0"
    assert [r.answer for r in train] == [r["answer"] for r in make_code_rows(60, SEED)[:50]]
    text = (root / "train.jsonl").read_text() + (root / "val.jsonl").read_text()
    assert not any(json.dumps(p.solution)[1:-1] in text for p in make_code_problems(60, SEED))


def test_ensure_code_task_writes_once(tmp_path):
    root = ensure_code_task(tmp_path, seed=SEED, n_train=20, n_val=5)
    stamp = (root / "train.jsonl").stat().st_mtime_ns
    assert ensure_code_task(tmp_path, seed=SEED, n_train=20, n_val=5) == root
    assert (root / "train.jsonl").stat().st_mtime_ns == stamp
    assert len(load_rows(str(root / "val.jsonl"))) == 5
    assert not list(root.glob("*.tmp"))


def test_tiny_code_model_writes_expressible_programs(tmp_path):
    """builtin:tiny-code: an ASCII tokenizer that round-trips prompts and programs as vLLM and the trainer
    load it, and a model that has learned the reply format a little."""
    import json

    from transformers import AutoTokenizer

    from app.tasks.code import make_code_problems
    from app.tasks.tiny import ensure_builtin_code

    root = ensure_builtin_code(tmp_path, warmup_steps=5)
    tok = AutoTokenizer.from_pretrained(root / "model")
    p = make_code_problems(1, 3)[0]
    for text in (p.prompt, f"```python\n{p.solution}\n```"):
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert len(tok.encode(p.prompt, add_special_tokens=False)) < 400  # fits configs/code.yaml
    assert json.loads((root / "build.json").read_text())["version"] >= 1
