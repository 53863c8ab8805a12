"""Code with feedback (`env.name=code_feedback`): the code task (`builtin:code`) as a multi-turn environment.

A model turn is a program (a ```python block, as the task's prompt asks). The environment runs it on the
row's hidden tests in the sandbox: app/rewards/code.py `code_feedback`, the code reward's own path (the same
isolation, per-test limits and budget), through the run's `Offload`, since the sandbox blocks: on a reward
worker when `reward.workers > 0` (where the code reward's sandbox runs too), else in a rollouter thread.
When every test passes the episode ends with reward 1. Otherwise the observation is a short report of the
first failing test (which test and how: the program's last stderr line for a crash, the input and the
program's output for a wrong answer; never the expected output), and the model tries again, up to
`env.max_turns`. The reward is the last attempt's score: the fraction of tests it passed (the code
reward's partial score).

A sandbox that fails (SandboxError) or a step over `env.step_timeout_s` ends the episode with
`reward.on_error`, counted as `env/errors_exception` / `env/errors_timeout` (app/rollout/episode.py). Each
step's sandbox budget stays below `env.step_timeout_s`, so a slow program is scored as a timeout (a test
result), not as the environment's failure.

Replay (app/envs/base.py): the state is the row's tests and nothing else, and a step's report depends only
on the program, so stepping again on a restored episode's turns rebuilds it (the recorded observation
tokens stay as they were in any case).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from app.envs.base import EnvStep, Offload, in_thread
from app.records import Prompt
from app.rewards.code import CODE_BUDGET_S, code_feedback

CheckFn = Callable[[str, str, float], tuple[dict, str]]  # (response, answer, budget_s) -> (score, report)
BUDGET_MARGIN_S = 1.0  # of env.step_timeout_s left to the sandbox's cleanup and the thread hand-off


def observation(report: str) -> str:
    """What the model reads after a failed attempt (environment tokens)."""
    return f"\n{report}\nFix the program; reply with it in a ```python block.\n"


def _check(response: str, answer: str, budget_s: float) -> tuple[dict, str]:
    return code_feedback(response, answer, budget_s=budget_s)


class CodeFeedbackEnv:
    """One episode of one code problem; `check` runs a response's program on the tests (the sandbox),
    through `offload`."""

    def __init__(
        self, budget_s: float = CODE_BUDGET_S, check: CheckFn = _check, offload: Offload = in_thread
    ) -> None:
        self.budget_s, self.check, self.offload = budget_s, check, offload
        self.answer = ""

    async def reset(self, prompt: Prompt) -> str:
        if not prompt.answer.strip():
            raise ValueError(
                f"prompt {prompt.uid}: code_feedback needs the row's tests as its answer "
                '(JSON {"tests": [{"input": ..., "output": ...}]}, as builtin:code writes them)'
            )
        self.answer = prompt.answer
        return ""

    async def step(self, turn: str) -> EnvStep:
        score, report = await self.offload(self.check, turn, self.answer, self.budget_s)
        reward = float(score["score"])
        extras = {k: float(v) for k, v in score.items() if k != "score"}
        if reward >= 1.0 or not report:
            return EnvStep(done=True, reward=reward, extras=extras)
        return EnvStep(observation=observation(report), reward=reward, extras=extras)


def factory(cfg: Any, offload: Offload = in_thread) -> Callable[[], CodeFeedbackEnv]:
    """Per-episode environments whose sandbox budget fits inside `env.step_timeout_s` (None: the defaults),
    running their sandbox through `offload`."""
    if cfg is None:
        return functools.partial(CodeFeedbackEnv, offload=offload)
    budget = min(CODE_BUDGET_S, float(cfg.env.step_timeout_s) - BUDGET_MARGIN_S)
    if budget < 1.0:
        raise ValueError(
            f"env.step_timeout_s={cfg.env.step_timeout_s}: code_feedback runs the tests of each attempt in "
            f"the sandbox within this deadline; set it to at least {CODE_BUDGET_S + BUDGET_MARGIN_S:g}"
        )
    return functools.partial(CodeFeedbackEnv, budget_s=budget, offload=offload)
