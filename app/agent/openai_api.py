"""The OpenAI-compatible chat endpoint: a Ray Serve application beside the rollout deployment.

    POST {ROUTE_PREFIX}/s/<session>/v1/chat/completions    a call recorded in session <session>
    GET  {ROUTE_PREFIX}/s/<session>/v1/models
    POST {ROUTE_PREFIX}/v1/chat/completions                 not recorded (trying the endpoint by hand)
    GET  {ROUTE_PREFIX}/v1/models

So an unmodified OpenAI client with `base_url=http://127.0.0.1:<port>/relay/s/<session>/v1` drives a
session. The protocol, the chat rendering and the session records are app/agent/openai_chat.py's `ChatCore`;
this module is its HTTP face: one FastAPI ingress deployment (`OpenAIFrontend`, no GPU) that generates
through a handle to the rollout deployment's `generate` (app/rollout/serve_generate.py: load-balanced over
the vLLM replicas, retried on a live one when a replica died), so a chat call carries behaviour log-probs
and per-token policy versions exactly as Relay's own rollouts do. Relay's runner
(app/agent/session.py) opens and takes sessions through the deployment's handle.

The frontend is one replica: sessions live in its memory (the runner takes each at the end; idle ones
expire). It is its own Serve application (`<ray.name>-openai`, route prefix `/relay`), so the rollout
application keeps no HTTP route and its handle users are untouched. Serve's HTTP proxy listens on loopback
at `env.http_port` (0: a free port), set when this run starts Serve (`start_http`); agents reach it on
127.0.0.1 of the rollouter's node.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve

from app.agent.openai_chat import ChatCore, ChatSettings, RequestError
from app.agent.openai_routes import ROUTE_PREFIX
from app.agent.session import SessionCall
from app.names import FRONTEND_DEPLOYMENT, frontend_app_name

log = logging.getLogger(__name__)


api = FastAPI(title="Relay OpenAI-compatible chat endpoint")


@serve.ingress(api)
class OpenAIFrontend:
    """The HTTP ingress (see the module docstring); `rollout_app` names the rollout application."""

    def __init__(self, model_path: str, settings: ChatSettings, rollout_app: str) -> None:
        from transformers import AutoTokenizer

        from app.names import DEPLOYMENT_NAME
        from app.rollout.serve_generate import ServeGenerate

        handle = serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=rollout_app)
        tok = AutoTokenizer.from_pretrained(model_path)
        self.core = ChatCore(tok, ServeGenerate(handle, settings.request_timeout_s), settings)

    async def _chat(self, sid: str | None, request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except Exception:
            return JSONResponse(RequestError("the body must be a JSON object").body(), status_code=400)
        if not isinstance(body, dict):
            return JSONResponse(RequestError("the body must be a JSON object").body(), status_code=400)
        try:
            return JSONResponse(await self.core.complete(sid, body))
        except RequestError as e:
            return JSONResponse(e.body(), status_code=e.status)
        except (TypeError, ValueError) as e:  # a field of the wrong type (e.g. max_tokens="many")
            return JSONResponse(RequestError(f"bad request: {e}").body(), status_code=400)
        except Exception as e:
            log.exception("chat completion failed")
            err = RequestError(f"generation failed: {type(e).__name__}: {e}", status=500)
            return JSONResponse(err.body(), status_code=500)

    @api.post("/s/{session}/v1/chat/completions")
    async def session_chat(self, session: str, request: Request) -> JSONResponse:
        return await self._chat(session, request)

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request) -> JSONResponse:
        return await self._chat(request.headers.get("x-relay-session"), request)

    @api.get("/s/{session}/v1/models")
    async def session_models(self, session: str) -> dict[str, Any]:
        return await self.models()

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        name = self.core.s.model_name
        return {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": 0, "owned_by": "relay"}],
        }

    async def open_session(self, sid: str, settings: dict[str, Any]) -> None:
        """Start recording session `sid` (called by Relay's runner through the handle)."""
        self.core.open_session(sid, settings)

    async def take_session(self, sid: str) -> list[SessionCall]:
        """The calls of session `sid`; the session ends."""
        return self.core.take_session(sid)


def build_frontend(cfg: Any, model_path: str) -> Any:
    """The frontend application of run `cfg.ray.name` (deploy it with route prefix ROUTE_PREFIX)."""
    from app.names import app_name

    opts = {
        "name": FRONTEND_DEPLOYMENT,
        "num_replicas": 1,  # sessions live in its memory
        "ray_actor_options": {"num_cpus": 0},
        "max_ongoing_requests": 1024,
        "logging_config": {"enable_access_log": cfg.log_level == "DEBUG"},
    }
    return serve.deployment(OpenAIFrontend, **opts).bind(
        model_path, ChatSettings.of(cfg), app_name(cfg.ray.name)
    )


def start_http(port: int) -> int:
    """Start Serve with its HTTP proxy on 127.0.0.1:`port` (0: a free port) unless it runs already;
    returns the port the proxy listens on (that of a Serve already running, which cannot change)."""
    from app.infra import ray_compat
    from app.weights.group import free_port

    ray_compat.while_serve_starts(
        lambda: serve.start(http_options={"host": "127.0.0.1", "port": port or free_port()})
    )
    actual = ray_compat.serve_http_port()
    if port and actual != port:
        log.warning(
            "env.http_port=%d: Serve already runs on this cluster with its proxy on port %d", port, actual
        )
    return actual


def deploy_frontend(cfg: Any, model_path: str) -> None:
    """Deploy this run's frontend (without waiting for it: its replica starts beside the rollout's)."""
    from app.infra import ray_compat

    ray_compat.deploy_app(
        build_frontend(cfg, model_path), frontend_app_name(cfg.ray.name), route_prefix=ROUTE_PREFIX
    )
