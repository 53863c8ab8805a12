"""The HumanEval reward (`reward.fn=humaneval`; `auto` for data_source `humaneval`): run a response's
function against the problem's tests in the code sandbox (app/rewards/sandbox.py).

The program is built the standard HumanEval way (Chen et al. 2021), from the row's answer (JSON with the
problem's `prompt`, `test` and `entry_point`, written by app/tasks/humaneval.py):

    code       the response's last ```python block, else its last untagged ``` block, else the whole text
    solution   HumanEval prompt + code (dedented), when the code defines `entry_point` at its top level: a
               full solution, which then replaces the prompt's stub while keeping the prompt's imports and
               helper functions; otherwise HumanEval prompt + code, the code being the function's body
    program    solution + test + `check(entry_point)` + a line that prints a secret read from stdin

It passes (1.0) when the program exits 0 and its last line of output is the secret: a response that exits
early (`sys.exit(0)`, `os._exit(0)`) skips the tests and does not pass. Everything else scores 0.0 with
one failure kind as an extra (1.0): syntax_error (the program does not compile: checked here, without a
sandbox), wrong_answer (an assertion of the tests failed), error (another exception), exited_early,
timeout, memory, killed or output_limit (the sandbox's statuses). One sandbox run, bounded by
`HUMANEVAL_LIMITS`: the reward never waits longer than its wall limit (plus the sandbox's start).
"""

from __future__ import annotations

import json
import re
import secrets
import textwrap
import warnings
from typing import Any

from app.rewards.code import extract_program
from app.rewards.sandbox import SandboxError, SandboxLimits, run_program

HUMANEVAL_LIMITS = SandboxLimits(cpu_s=3.0, wall_s=6.0)
"""Limits of one program: 3 s of CPU as OpenAI's harness allows (a canonical solution with its tests takes
well under 1 s); the wall limit leaves room for a loaded machine and stays below the default
reward.timeout_s of 10 s, so the sandbox's deadline, not the scoring process's, ends a hung program."""


def _problem(answer: str) -> dict[str, str]:
    """The problem of a row's answer; ValueError (a dataset bug, not the model's) when malformed."""
    try:
        spec = json.loads(answer)
        problem = {k: spec[k] for k in ("prompt", "test", "entry_point")}
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(
            f'humaneval answer must be JSON {{"prompt", "test", "entry_point"}}, got {answer!r:.200}'
        ) from e
    if not all(isinstance(v, str) for v in problem.values()) or not problem["entry_point"].isidentifier():
        raise ValueError(f"humaneval answer has a non-string field or a bad entry_point: {answer!r:.200}")
    return problem


def build_solution(code: str, prompt: str, entry_point: str) -> str:
    """The solution program of `code` (taken from a response) to the HumanEval `prompt`: the prompt, then
    the code dedented when it defines `entry_point` at its top level (a full function: its definition comes
    last, so it wins over the prompt's stub), else the code as it is (the body of the prompt's function)."""
    full = textwrap.dedent(code)
    if re.search(rf"^(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(", full, re.MULTILINE):
        return f"{prompt.rstrip()}\n\n\n{full}"
    return prompt + code


def build_program(response: str, answer: str) -> str:
    """The program that tests `response` on the problem in `answer`: solution, tests, `check(entry_point)`,
    then a line that prints what it reads from stdin (the caller's secret, see the module docstring)."""
    problem = _problem(answer)
    solution = build_solution(extract_program(response), problem["prompt"], problem["entry_point"])
    epilogue = "import sys as _sys\nprint(_sys.stdin.readline().strip())"
    return f"{solution}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n{epilogue}\n"


def _compiles(program: str) -> bool:
    """Whether the program compiles (compiling runs nothing of it); its warnings are not ours to print."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            compile(program, "prog.py", "exec")
        except (SyntaxError, ValueError, RecursionError):  # ValueError: null bytes; RecursionError: nesting
            return False
    return True


def humaneval_reward(response: str, answer: str, limits: SandboxLimits = HUMANEVAL_LIMITS) -> dict[str, Any]:
    """Score a response to a HumanEval problem (`answer`: JSON `{"prompt", "test", "entry_point"}`):
    `{"score": 1.0}` when the problem's tests pass, else `{"score": 0.0, KIND: 1.0}` with KIND one of
    syntax_error, wrong_answer, error, exited_early, timeout, memory, killed, output_limit (the module
    docstring says how the program is built and judged). Never raises for what the program does; raises
    SandboxError when the sandbox itself fails and ValueError for a malformed `answer`."""
    secret = secrets.token_hex(16)
    program = build_program(response, answer)
    if not _compiles(program):
        return {"score": 0.0, "syntax_error": 1.0}
    res = run_program(program, secret + "\n", limits)
    if res.status == "sandbox_error":
        raise SandboxError(f"sandbox failed: {res.detail}")
    if res.status == "ok":
        lines = res.stdout.strip().splitlines()
        if lines and lines[-1].strip() == secret:
            return {"score": 1.0}
        return {"score": 0.0, "exited_early": 1.0}
    if res.status == "error":
        last = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
        kind = "wrong_answer" if last and last[-1].startswith("AssertionError") else "error"
        return {"score": 0.0, kind: 1.0}
    return {"score": 0.0, res.status: 1.0}
