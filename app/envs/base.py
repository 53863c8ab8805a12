"""The environment protocol: what a multi-turn, tool-using rollout talks to between the model's turns.

An episode starts with `reset(prompt)` (its first observation, "" for none) and then alternates: the model
writes a turn, `step(turn_text)` answers with an `EnvStep` (an observation appended to the trajectory as
environment tokens, a reward, and whether the episode is done). Both are async; a blocking environment
hands its work to the run's `Offload`: a blocking, picklable function runs beside generation, on a reward
worker (a Ray actor, `reward.workers > 0`) like rewards do, else in a thread of the rollouter. Instances are
per episode (one per sample), built by the factory registered in `app/envs/__init__.py` `ENVIRONMENTS`.

Replay: a checkpoint freezes an episode mid-trajectory as its tokens and loss mask only. A restored run
rebuilds the environment's state by calling `reset` and then `step` again on each finished model turn, so
`step` must be a deterministic function of the episode so far (true of every built-in environment; an
environment with outside state keeps it keyed by the prompt's uid).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from app.records import Prompt


@dataclass(kw_only=True)
class EnvStep:
    """The environment's answer to one model turn."""

    observation: str = ""  # appended as environment tokens (masked out of the loss)
    reward: float = 0.0  # the episode's reward if this step ends it
    done: bool = False
    tool_call: bool = False  # the turn called a tool (counted as env/tool_calls)
    extras: dict[str, float] = field(default_factory=dict)  # numeric sub-scores, logged as reward/sub/*


class Environment(Protocol):
    async def reset(self, prompt: Prompt) -> str:
        """Start an episode for `prompt`; returns its first observation ("" when the prompt is all)."""
        ...

    async def step(self, turn: str) -> EnvStep:
        """React to the model's turn `turn` (its text, without the end-of-sequence token)."""
        ...


Offload = Callable[..., Awaitable[Any]]
"""`await offload(fn, *args)` -> `fn(*args)`, run beside generation (app/rewards/pool.py `RewardPool.offload`:
on the least busy reward worker when there are any). `fn` blocks and is picklable (a module-level function)."""


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """The `Offload` without reward workers (and in tests): `fn(*args)` in a thread of this process."""
    return await asyncio.to_thread(fn, *args)


class EnvFactory(Protocol):
    def __call__(self) -> Environment: ...
