"""The code-task reward: a response's program run on the hidden tests of its answer, in the code sandbox.

`code_reward` scores `builtin:code` (app/tasks/code.py writes its answers, `{"tests": [{"input", "output"}]}`);
`code_feedback` also says how the first failing test failed, for the code-feedback environment
(app/envs/code_feedback.py). Each test runs the program once, in its own sandbox (app/rewards/sandbox.py), up
to `TEST_PARALLEL` of a response's tests at once, within `CODE_BUDGET_S` for the whole response.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import replace

from app.rewards.sandbox import RunResult, SandboxError, SandboxLimits, run_program

_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[^\n]*\n(.*?)^[ \t]*```", re.DOTALL | re.MULTILINE)
_PYTHON_TAGS = ("python", "python3", "py")


def extract_program(response: str) -> str:
    """The last ```python fenced block of a response, else its last untagged ``` block, else the whole
    text. Fences must start a line; an unclosed fence is no block."""
    blocks = _FENCE.findall(response)
    python = [body for tag, body in blocks if tag.lower() in _PYTHON_TAGS]
    untagged = [body for tag, body in blocks if not tag]
    return (python or untagged or [response])[-1]


def _normalize(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _parse_tests(answer: str) -> list[dict[str, str]]:
    """The tests of an answer string; raises ValueError (a dataset bug, not the model's) when malformed."""
    try:
        spec = json.loads(answer)
        tests = spec["tests"]
        parsed = [{"input": str(t["input"]), "output": str(t["output"])} for t in tests]
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(
            f'code answer must be JSON {{"tests": [{{"input": ..., "output": ...}}]}}, got {answer!r:.200}'
        ) from e
    if not parsed:
        raise ValueError(f"code answer has no tests: {answer!r:.200}")
    return parsed


CODE_LIMITS = SandboxLimits(cpu_s=1.0, wall_s=4.0)
"""Limits of one test run of `code_reward`: 1 s of CPU stops busy loops; the wall limit leaves room for
a loaded machine (sandbox start included) and only bites programs that sleep or block."""
CODE_BUDGET_S = 8.0
"""Wall-clock budget of one `code_reward` call, below the default reward.timeout_s of 10 s."""

TEST_PARALLEL = 4
"""Most tests of one response that run at once (each in its own sandbox): a response's reward waits for its
slowest test, not for the sum of them, so a trajectory is scored soon after it finishes."""


def _check_test(
    program: str, test: dict[str, str], limits: SandboxLimits, deadline: float
) -> tuple[str, RunResult | None]:
    """("pass" or why the test failed: a run status or "wrong_answer"; the run's result, None when the
    budget was spent before it ran). Raises SandboxError when the sandbox itself fails."""
    left = deadline - time.monotonic()
    if left < 0.5:  # the budget is spent: fails as a timeout without running
        return "timeout", None
    res = run_program(program, test["input"], replace(limits, wall_s=min(limits.wall_s, left)))
    if res.status == "sandbox_error":
        raise SandboxError(f"sandbox failed: {res.detail}")
    if res.status != "ok":
        return res.status, res
    return ("pass" if _normalize(res.stdout) == _normalize(test["output"]) else "wrong_answer"), res


def run_tests(
    program: str,
    tests: list[dict[str, str]],
    limits: SandboxLimits = CODE_LIMITS,
    deadline: float | None = None,
    parallel: int = TEST_PARALLEL,
) -> list[tuple[str, RunResult | None]]:
    """`_check_test` for each test (in order), up to `parallel` of them at once, each in its own sandbox;
    tests not started when `deadline` (monotonic; default: `CODE_BUDGET_S` from now) is near fail as
    timeouts. Raises SandboxError when the sandbox itself fails."""
    deadline = time.monotonic() + CODE_BUDGET_S if deadline is None else deadline
    if parallel <= 1 or len(tests) <= 1:
        return [_check_test(program, t, limits, deadline) for t in tests]
    from concurrent.futures import ThreadPoolExecutor

    # each run's thread waits for its sandbox to exit (the sandbox dies with that thread: pdeathsig)
    with ThreadPoolExecutor(min(parallel, len(tests)), thread_name_prefix="sandbox-test") as pool:
        return list(pool.map(lambda t: _check_test(program, t, limits, deadline), tests))


def code_reward(
    response: str, answer: str, limits: SandboxLimits = CODE_LIMITS, budget_s: float = CODE_BUDGET_S
) -> dict:
    """Score a response's program on the tests in `answer` (`{"tests": [{"input", "output"}, ...]}`).

    Each test runs the program once with its input on stdin; it passes when the stripped stdout equals
    the stripped expected output (trailing spaces of lines ignored). Tests still to run when `budget_s`
    is spent fail as timeouts. Returns `{"score": passed/total, "passed": n, "total": m}` plus
    `{KIND: 1.0}` for the first failing test, KIND being the run status (error, timeout, memory, killed,
    output_limit) or "wrong_answer". Never raises for what the program does; raises SandboxError when the
    sandbox itself fails and ValueError for a malformed `answer`.
    """
    return code_feedback(response, answer, limits, budget_s)[0]


FEEDBACK_CHARS = 400
"""Most characters of test output `code_feedback` reports (each quoted stream is also cut to a line)."""


def code_feedback(
    response: str,
    answer: str,
    limits: SandboxLimits = CODE_LIMITS,
    budget_s: float = CODE_BUDGET_S,
    max_chars: int = FEEDBACK_CHARS,
) -> tuple[dict, str]:
    """`code_reward`'s score and a short report of the first failing test ("" when all pass), for a model
    to fix its program: which test failed and how, with the last line of the program's stderr (the
    exception) for a crash, or the test's input and the program's output for a wrong answer. The expected
    output is never shown (a model could print it back). At most `max_chars` characters. Same deadlines
    and errors as `code_reward`."""
    tests = _parse_tests(answer)
    checked = run_tests(extract_program(response), tests, limits, time.monotonic() + budget_s)
    outcomes = [o for o, _ in checked]
    passed = outcomes.count("pass")
    out: dict = {"score": passed / len(tests), "passed": passed, "total": len(tests)}
    failed = next((i for i, o in enumerate(outcomes) if o != "pass"), None)
    if failed is None:
        return out, ""
    out[outcomes[failed]] = 1.0
    report = _failure_report(failed, len(tests), outcomes[failed], tests[failed], checked[failed][1])
    return out, report[:max_chars]


def _last_line(text: str, limit: int = 160) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:limit] if lines else ""


def _failure_report(i: int, total: int, kind: str, test: dict[str, str], res: RunResult | None) -> str:
    head = f"Test {i + 1} of {total} failed: {kind.replace('_', ' ')}."
    if res is None:
        return f"{head} (out of time before it ran)"
    if kind == "wrong_answer":
        got = _last_line(res.stdout) if res.stdout.strip() else "(nothing)"
        return f"{head}\nInput: {_last_line(test['input'])}\nYour output: {got}"
    err = _last_line(res.stderr) or res.detail
    return f"{head}\n{err}" if err else head
