"""Environments for multi-turn rollouts (`env.name`): a new one is a module here plus one registry line.

`ENVIRONMENTS` maps a name to a kind of environment (`EnvKind`, or a plain `(cfg, offload) -> EnvFactory`
function): what builds the run's factory of per-episode environments, and what else the kind needs of the
run (see `app/envs/base.py`). A built-in kind that lives in a package of its own is registered by its
`pkg.module:Name` and imported when named: `openai_agent`, whose agent sessions (app/agent/) are built on the
rollout's internals and on this package's base. Importing this package imports neither torch, Ray nor vLLM
(the config validates `env.name` against it and runs its kind's `check`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.envs.base import EnvFactory, Environment, EnvKind, EnvStep, Offload, in_thread
from app.envs.calculator import CalculatorEnv
from app.envs.code_feedback import factory as code_feedback_envs
from app.plugins import resolve

ENVIRONMENTS: dict[str, EnvKind | Callable[[Any, Offload], EnvFactory] | str] = {
    # name -> ((the run's config, where blocking work runs) -> a factory of one environment per episode)
    "calculator": lambda cfg, offload: CalculatorEnv,
    "code_feedback": code_feedback_envs,
    # agent code drives whole sessions through the OpenAI endpoint (imported when named: app/agent imports
    # app/envs/base.py, so this package must not import it)
    "openai_agent": "app.agent.kind:OPENAI_AGENT",
}


def env_kind(name: str) -> EnvKind:
    """The kind `env.name` names (for "", single-turn sampling: a kind that does nothing); a plain function
    is wrapped as a kind with no hooks."""
    if not name:
        return EnvKind()
    found = resolve("env.name", name, ENVIRONMENTS)
    if isinstance(found, str):  # a built-in kind of another package, by its `pkg.module:Name`
        found = resolve("env.name", found)
    return found if isinstance(found, EnvKind) else EnvKind(found)


def make_factory(name: str, cfg: Any, offload: Offload = in_thread) -> EnvFactory | None:
    """The factory of `env.name` (None for "": single-turn sampling); its environments run their blocking
    work through `offload` (the rollouter passes its reward pool's: on reward workers when there are any)."""
    return env_kind(name)(cfg, offload) if name else None


__all__ = [
    "ENVIRONMENTS",
    "EnvFactory",
    "EnvKind",
    "EnvStep",
    "Environment",
    "Offload",
    "env_kind",
    "in_thread",
    "make_factory",
]
