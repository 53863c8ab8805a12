"""The `env.name=openai_agent` kind: agent code drives each sample through the OpenAI-compatible endpoint.

The kind deploys the endpoint beside the rollout (Serve's HTTP proxy on a loopback port before Serve starts,
then the frontend application after the rollout deployment) and removes it at the end of the run; its
`env.agent` names the agent function, resolved at load so a typo fails before Ray starts. The episodes are
app/agent/session.py's. Importing this module imports neither torch, Ray nor vLLM.
"""

from __future__ import annotations

from typing import Any

from app.envs.base import EnvFactory, EnvKeyError, EnvKind, Offload


class OpenAIAgentKind(EnvKind):
    """Agent sessions through the OpenAI endpoint (`env.agent`, `env.agent_timeout_s`, `env.http_port`)."""

    def __call__(self, cfg: Any, offload: Offload) -> EnvFactory:
        from app.agent.session import AgentEpisodes

        return AgentEpisodes(cfg)

    def check(self, env: Any) -> None:
        if ":" not in env.agent:
            raise EnvKeyError(
                "agent",
                f"{env.agent!r}: env.name=openai_agent runs the agent function named here; set "
                "env.agent=pkg.module:function (an async function (base_url, row) -> reward)",
            )
        from app.agent.session import resolve_agent

        try:
            resolve_agent(env.agent)
        except ValueError as e:
            raise EnvKeyError("agent", str(e)) from None

    def before_serve(self, cfg: Any) -> Any:
        from omegaconf import OmegaConf

        from app.agent.openai_api import start_http

        return OmegaConf.merge(cfg, {"env": {"http_port": start_http(cfg.env.http_port)}})

    def deploy(self, cfg: Any, model_path: str) -> None:
        from app.agent.openai_api import deploy_frontend

        deploy_frontend(cfg, model_path)

    def teardown(self, cfg: Any) -> None:
        from app.infra import ray_compat
        from app.names import frontend_app_name

        ray_compat.delete_app(frontend_app_name(cfg.ray.name), wait=False)


OPENAI_AGENT = OpenAIAgentKind()
"""The kind registered as `env.name=openai_agent` (app/envs/__init__.py `ENVIRONMENTS`)."""
