"""Environments for multi-turn rollouts (`env.name`): a new one is a module here plus one registry line.

`ENVIRONMENTS` maps a name to a factory of per-episode environments (see `app/envs/base.py`). Importing
this package imports neither torch, Ray nor vLLM (the config validates `env.name` against it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.envs.base import EnvFactory, Environment, EnvStep
from app.envs.calculator import CalculatorEnv
from app.envs.code_feedback import factory as code_feedback_envs

ENVIRONMENTS: dict[str, Callable[[Any], EnvFactory]] = {
    # name -> (the run's config -> a factory of one environment per episode)
    "calculator": lambda cfg: CalculatorEnv,
    "code_feedback": code_feedback_envs,
    "openai_agent": lambda cfg: _openai_agent(cfg),
}


def _openai_agent(cfg: Any) -> EnvFactory:
    """Agent code driving whole sessions through the OpenAI endpoint (app/rollout/agent_session.py)."""
    from app.rollout.agent_session import AgentEpisodes

    return AgentEpisodes(cfg)


def make_factory(name: str, cfg: Any) -> EnvFactory | None:
    """The factory of `env.name` (None for "": single-turn sampling)."""
    if not name:
        return None
    if name not in ENVIRONMENTS:
        raise ValueError(
            f"env.name={name!r} is not a registered environment; choose one of {sorted(ENVIRONMENTS)}"
        )
    return ENVIRONMENTS[name](cfg)


__all__ = ["ENVIRONMENTS", "EnvFactory", "EnvStep", "Environment", "make_factory"]
