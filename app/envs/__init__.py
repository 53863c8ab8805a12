"""Environments for multi-turn rollouts (`env.name`): a new one is a module here plus one registry line.

`ENVIRONMENTS` maps a name to a factory of per-episode environments (see `app/envs/base.py`). Importing
this package imports neither torch, Ray nor vLLM (the config validates `env.name` against it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.envs.base import EnvFactory, Environment, EnvStep, Offload, in_thread
from app.envs.calculator import CalculatorEnv
from app.envs.code_feedback import factory as code_feedback_envs

ENVIRONMENTS: dict[str, Callable[[Any, Offload], EnvFactory]] = {
    # name -> ((the run's config, where blocking work runs) -> a factory of one environment per episode)
    "calculator": lambda cfg, offload: CalculatorEnv,
    "code_feedback": code_feedback_envs,
    "openai_agent": lambda cfg, offload: _openai_agent(cfg),
}


def _openai_agent(cfg: Any) -> EnvFactory:
    """Agent code driving whole sessions through the OpenAI endpoint (app/envs/agent/session.py)."""
    from app.envs.agent.session import AgentEpisodes

    return AgentEpisodes(cfg)


def make_factory(name: str, cfg: Any, offload: Offload = in_thread) -> EnvFactory | None:
    """The factory of `env.name` (None for "": single-turn sampling); its environments run their blocking
    work through `offload` (the rollouter passes its reward pool's: on reward workers when there are any)."""
    if not name:
        return None
    from app.plugins import resolve

    return resolve("env.name", name, ENVIRONMENTS)(cfg, offload)


__all__ = ["ENVIRONMENTS", "EnvFactory", "EnvStep", "Environment", "Offload", "in_thread", "make_factory"]
