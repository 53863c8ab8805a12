"""Every name a run gives its Ray actors and Serve applications, in one place.

A run's names all start with its `ray.name` (the prefix), so two runs on one cluster never meet; the named
actors live in one Ray namespace, reachable from Serve replicas and from jobs. Imports nothing.

    what                                   name
    rollout Serve application              <prefix>-rollout, deployment `rollout`
    OpenAI-compatible front end (agents)   <prefix>-openai, deployment `openai`
    rollouter actor                        <prefix>-rollouter
    weight hub actor                       <prefix>-weight-hub
    run control actor                      <prefix>-run-control
"""

from __future__ import annotations

NAMESPACE = "relay"
"""The Ray namespace of a run's named actors (hub, control, rollouter)."""
DEPLOYMENT_NAME = "rollout"
"""The rollout application's Serve deployment (the vLLM replicas)."""
FRONTEND_DEPLOYMENT = "openai"
"""The OpenAI-compatible front end's Serve deployment."""


def app_name(prefix: str) -> str:
    """The rollout Serve application of run `prefix`."""
    return f"{prefix}-rollout"


def frontend_app_name(prefix: str) -> str:
    """The Serve application of run `prefix`'s OpenAI-compatible front end."""
    return f"{prefix}-openai"


def rollouter_name(prefix: str) -> str:
    """The rollouter's Ray actor name for run `prefix`."""
    return f"{prefix}-rollouter"


def hub_name(prefix: str) -> str:
    """The weight hub's Ray actor name for run `prefix`."""
    return f"{prefix}-weight-hub"


def control_name(prefix: str) -> str:
    """The run control's Ray actor name for run `prefix`."""
    return f"{prefix}-run-control"
