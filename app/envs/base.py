"""The environment protocol: what a multi-turn, tool-using rollout talks to between the model's turns.

An episode starts with `reset(prompt)` (its first observation, "" for none) and then alternates: the model
writes a turn, `step(turn_text)` answers with an `EnvStep` (an observation appended to the trajectory as
environment tokens, a reward, and whether the episode is done). Both are async; a blocking environment
hands its work to the run's `Offload`: a blocking, picklable function runs beside generation, on a reward
worker (a Ray actor, `reward.workers > 0`) like rewards do, else in a thread of the rollouter. Instances are
per episode (one per sample), built by the factory registered in `app/envs/__init__.py` `ENVIRONMENTS`.

What `env.name` names is an `EnvKind`: it builds the run's factory of environments, and a kind that needs more
of the run (keys of its own checked at load, a service deployed beside the rollout) overrides its hooks; the
config and the driver call the hooks of every kind and check no name. A factory that runs whole episodes
itself (agent sessions) is an `EpisodeMaker`.

An episode runner (app/rollout/episode.py, app/agent/session.py) sees the generator as `Turns`: one
model turn at a time, the tokenizer, the run's counters and the checkpoint's freeze. `GroupGenerator`
(app/rollout/generator.py) implements it.

Replay: a checkpoint freezes an episode mid-trajectory as its tokens and loss mask only. A restored run
rebuilds the environment's state by calling `reset` and then `step` again on each finished model turn, so
`step` must be a deterministic function of the episode so far (true of every built-in environment; an
environment with outside state keeps it keyed by the prompt's uid).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from app.config import EnvConfig
from app.records import GenerateRequest, Prompt, Sample
from app.rewards import RewardResult


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


class Turns(Protocol):
    """What an episode runner needs of the generator: model turns, the tokenizer, counters, the freeze."""

    stats: Counter[str]  # the run's counters (env/errors_*, env/steps, ...)
    freezing: bool  # a checkpoint's freeze: an episode ends as a partial sample

    async def turn(self, uid: str, req: GenerateRequest) -> Sample:
        """One sample of `req` (n=1) for prompt `uid`, within `rollout.request_timeout_s`; one a push
        aborted is continued as the run's partial-rollout policy says (its tokens keep their versions)."""
        ...

    def decode(self, ids: list[int]) -> str: ...

    def encode(self, text: str) -> list[int]: ...


class EpisodeRunner(Protocol):
    async def run(
        self, prompt: Prompt, req: GenerateRequest, partial: Sample | None
    ) -> tuple[Sample, RewardResult | None]:
        """One sample's episode (continuing `partial`, a frozen one) and its reward (None: frozen again)."""
        ...


class EpisodeMaker(ABC):
    """A factory that runs whole episodes itself (app/agent: agent sessions) instead of giving per-turn
    environments: `GroupGenerator` runs each sample through `make_episode(turns, env, on_error).run(prompt,
    req, partial)`, which returns the sample and its reward."""

    @abstractmethod
    def make_episode(self, turns: Turns, env: EnvConfig, on_error: float) -> EpisodeRunner:
        """The runner of episodes generated through `turns`, bounded by the config's `env` section; a failed
        episode scores `on_error` (`reward.on_error`)."""


class EnvKeyError(ValueError):
    """A key of the `env` section that this kind of environment cannot run with: `key` (e.g. "agent") and,
    in the message, what to set."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


class EnvKind:
    """What `env.name` names (app/envs ENVIRONMENTS, or `pkg.module:Name`): `kind(cfg, offload)` builds the
    run's factory of environments. A plain function `(cfg, offload) -> EnvFactory` is a kind with nothing else
    to do (`EnvKind(fn)`); a kind that needs more of the run subclasses this and overrides the hooks, which do
    nothing here."""

    def __init__(self, build: Callable[[Any, Offload], EnvFactory] | None = None) -> None:
        self.build = build

    def __call__(self, cfg: Any, offload: Offload) -> EnvFactory:
        if self.build is None:
            raise NotImplementedError(f"{type(self).__name__} builds no environments: override __call__")
        return self.build(cfg, offload)

    def check(self, env: Any) -> None:
        """At load, before Ray starts: raise EnvKeyError for a key of `env` (the config's `env` section) that
        this kind cannot run with."""

    def before_serve(self, cfg: Any) -> Any:
        """Before Ray Serve starts: the run's config, with what this kind's services chose (e.g. a port)."""
        return cfg

    def deploy(self, cfg: Any, model_path: str) -> None:
        """After the rollout deployment: deploy the services this kind's environments talk to."""

    def teardown(self, cfg: Any) -> None:
        """At the end of the run: remove what `deploy` deployed (the driver logs its errors, never raises)."""
