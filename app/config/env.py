"""`env.*`: multi-turn episodes, the environment that answers each model turn, and the OpenAI-compatible agent.
That `env.name` is a registered environment, and the keys its kind needs, are checked by app/preflight.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from app.config.base import _TIMEOUT, Range, _Section, rng


@dataclass
class EnvConfig(_Section):
    name: str = ""
    """Multi-turn rollouts: the environment (a key of app/envs ENVIRONMENTS, e.g. `calculator`) that answers
    each model turn until the episode is done; its observations are appended as tokens masked out of the
    loss and it gives the reward. "" (the default): one response per sample, scored by `reward.fn`."""
    max_turns: int = 4
    """Model turns per episode at most; an episode cut here keeps its last step's reward."""
    max_total_tokens: int = 64
    """Response tokens (model and environment together) per episode at most; each turn is also capped at
    rollout.max_tokens."""
    step_timeout_s: float = 10.0
    """Deadline of one environment call; one that raises or hangs ends the episode with reward.on_error
    (counted as env/errors_exception, env/errors_timeout)."""
    # env.name=openai_agent: agent code drives each sample through the OpenAI-compatible endpoint
    agent: str = ""
    """With env.name=openai_agent: the agent function `pkg.module:function`, `async def agent(base_url, row)`:
    it chats through an OpenAI client at `base_url` (one session per sample) and returns the sample's reward
    (a number, or a dict with `score`); the session becomes the trajectory (app/agent/session.py)."""
    agent_timeout_s: float = 120.0
    """Deadline of one agent session; an agent that raises or misses it scores reward.on_error."""
    http_port: int = 0
    """With env.name=openai_agent: the loopback port of Serve's HTTP proxy, which serves the endpoint under
    /relay (0: a free port); a Serve already running on the cluster keeps its own."""

    _RANGES: ClassVar[dict[str, Range]] = {
        "max_turns": rng(">= 1"),
        "max_total_tokens": rng(">= 1"),
        "step_timeout_s": _TIMEOUT,
        "agent_timeout_s": _TIMEOUT,
        "http_port": rng(">= 0", "0 picks a free port"),
    }
