"""The calculator environment (`env.name=calculator`), the tool of the built-in task `builtin:calc`.

A model turn is either a tool call, `[a*b]` (or `+`, `-`), whose value the environment appends as the
observation `>value|`, or a final answer, which ends the episode with reward 1 when it equals the prompt's
answer (else 0). A malformed call gets `>?|`. Deterministic, so a frozen episode replays exactly.
"""

from __future__ import annotations

import re

from app.envs.base import EnvStep
from app.records import Prompt

CALL = re.compile(r"\[(\d{1,9})([-+*])(\d{1,9})\]")
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def observation(value: str) -> str:
    return f">{value}|"


class CalculatorEnv:
    def __init__(self) -> None:
        self.answer = ""

    async def reset(self, prompt: Prompt) -> str:
        self.answer = prompt.answer.strip()
        return ""

    async def step(self, turn: str) -> EnvStep:
        text = turn.strip()
        if text.startswith("["):
            m = CALL.fullmatch(text)
            value = str(OPS[m[2]](int(m[1]), int(m[3]))) if m else "?"
            return EnvStep(observation=observation(value), tool_call=True)
        correct = float(text == self.answer)
        return EnvStep(done=True, reward=correct, extras={"correct": correct})
