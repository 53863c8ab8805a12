"""Agent sessions: agent code written against an OpenAI client drives a sample's rollout (`env.name=openai_agent`).

For each sample the runner (`AgentEpisode`) opens a session on the OpenAI-compatible frontend
(app/agent/openai_api.py), calls the user's agent function (`env.agent`, `async def agent(base_url, row)`) with
the session's base URL, and waits for its reward, within `env.agent_timeout_s` (a number, or a dict with a
`score`, numeric sub-scores and `tool_calls`: `agent_reward`). The frontend records
every chat call of the session (`SessionCall`: prompt token ids, completion token ids with their behaviour
log-probs and policy versions); `assemble` turns the record into one trajectory, a `Sample` whose tokens
are what the model saw and wrote after the row's prompt:

    prompt ids of the row | rest of call 1's prompt (0) | completion 1 (1) | what call 2's prompt added (0) | ...

(1: a model token, in the loss, with its log-prob and version; 0: environment tokens, masked out, log-prob 0,
the version of the model token before them.) A session must be prefix-consistent: each call's prompt
extends the previous call's prompt + completion token for token (true when the agent appends to one
conversation; the frontend builds each prompt on the previous one's tokens for that reason), and the first
call's prompt starts with the row's prompt tokens (send the row's prompt as the conversation's start: the
frontend renders chat messages as app/rollout/prompt_files.py renders chat prompts). An inconsistent session, an agent that
raises or misses its deadline, or a reward that is not a finite number scores `reward.on_error` and is
counted (`env/errors_inconsistent`, `_exception`, `_timeout`, `_invalid`); the consistent part of the
trajectory is kept, its model tokens trained with that reward, like a failed environment's episode.

An agent's own state lives in its code, so a session cannot be frozen and resumed: a checkpoint's freeze
cancels the agent (the sample goes back as an empty partial one) and a restored run starts it again.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import time
import uuid
from dataclasses import dataclass
from typing import Any

from app.config import EnvConfig
from app.envs.base import EpisodeMaker, Turns
from app.records import GenerateRequest, Prompt, Sample
from app.rewards import RewardResult
from app.rollout.episode import Trajectory

log = logging.getLogger(__name__)

FREEZE_POLL_S = 0.2
CALL_TIMEOUT_S = 30.0  # opening or taking a session (a frontend call that does no generation)


@dataclass(kw_only=True)
class SessionCall:
    """One chat call of a session, as generated: the prompt's token ids and the completion's, with the
    behaviour log-prob and policy version of each completion token."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    replica: str = ""
    seconds: float = 0.0  # wall time of the call's generation


class Inconsistent(ValueError):
    """A session whose calls do not extend one another: `traj` is the trajectory of its consistent part."""

    def __init__(self, detail: str, traj: Trajectory) -> None:
        super().__init__(detail)
        self.traj = traj


def assemble(prompt_ids: list[int], calls: list[SessionCall]) -> Trajectory:
    """The trajectory of a session's `calls` after the row's `prompt_ids` (see the module docstring).
    Raises Inconsistent (carrying the consistent part) when a call's prompt does not extend the context."""
    traj = Trajectory()
    ctx = list(prompt_ids)
    for i, c in enumerate(calls):
        if c.prompt_ids[: len(ctx)] != ctx:
            at = next((k for k, (a, b) in enumerate(zip(c.prompt_ids, ctx, strict=False)) if a != b), None)
            where = f"differs at token {at}" if at is not None else f"is shorter ({len(c.prompt_ids)} tokens)"
            what = "the row's prompt" if i == 0 else f"call {i}'s prompt + completion"
            raise Inconsistent(
                f"call {i + 1}'s prompt does not extend {what} ({len(ctx)} tokens): it {where}; an agent must "
                "append to one conversation (send the whole history each time, the model's replies unchanged)",
                traj,
            )
        traj.add_env(c.prompt_ids[len(ctx) :])
        traj.add_model(
            Sample(
                token_ids=list(c.completion_ids),
                logprobs=list(c.logprobs),
                versions=list(c.versions),
                finish_reason=c.finish_reason,
                replica=c.replica,
            )
        )
        traj.turns += 1
        ctx = [*c.prompt_ids, *c.completion_ids]
    return traj


def resolve_agent(spec: str) -> Any:
    """The agent function named by `env.agent` (`pkg.module:function`); raises ValueError naming the fix."""
    module, _, attr = spec.partition(":")
    hint = f"env.agent={spec!r}: expected 'pkg.module:function', an async function (base_url, row) -> reward"
    if not module or not attr:
        raise ValueError(f"{hint}; {spec!r} is not of that form")
    from app.plugins import PluginError, resolve

    try:
        obj: Any = resolve("env.agent", spec)
    except PluginError as e:
        cause = e.__cause__
        why = f"{type(cause).__name__}: {cause}" if cause else e.reason
        raise ValueError(f"{hint}; cannot import it ({why})") from e
    if not callable(obj):
        raise ValueError(f"{hint}; {attr!r} is a {type(obj).__name__}, not a function")
    try:
        inspect.signature(obj).bind("http://x/v1", {})
    except TypeError as e:
        raise ValueError(f"{hint}; it must accept (base_url, row): {e}") from e
    return obj


class AgentError(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind, self.detail = kind, detail


class AgentEpisodes(EpisodeMaker):
    """The factory `env.name=openai_agent` builds (app/agent/kind.py): not of per-turn environments but
    a maker of whole episodes (`EpisodeMaker`), which `GroupGenerator` asks for through `make_episode`."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.agent = resolve_agent(cfg.env.agent)

    def __call__(self) -> Any:
        raise TypeError("openai_agent runs whole agent sessions: GroupGenerator uses make_episode()")

    def make_episode(self, turns: Turns, env: EnvConfig, on_error: float) -> AgentEpisode:
        from ray import serve

        from app.agent.openai_routes import ROUTE_PREFIX
        from app.infra import ray_compat
        from app.names import FRONTEND_DEPLOYMENT, frontend_app_name

        handle = serve.get_deployment_handle(
            FRONTEND_DEPLOYMENT, app_name=frontend_app_name(self.cfg.ray.name)
        )
        base = f"http://127.0.0.1:{ray_compat.serve_http_port()}{ROUTE_PREFIX}"
        return AgentEpisode(turns, self.agent, handle, base, env, on_error)


class AgentEpisode:
    """Runs one sample as an agent session (see the module docstring); `frontend` is the OpenAI frontend's
    Serve handle, `base` its URL up to the session part. `env` (the config's section) bounds a session's
    calls (`max_turns`) and time (`agent_timeout_s`); a failed session scores `on_error`."""

    def __init__(
        self, turns: Turns, agent: Any, frontend: Any, base: str, env: EnvConfig, on_error: float
    ) -> None:
        self.turns, self.agent, self.frontend, self.base = turns, agent, frontend, base
        self.max_calls, self.timeout_s, self.on_error = env.max_turns, env.agent_timeout_s, on_error

    async def run(
        self, prompt: Prompt, req: GenerateRequest, partial: Sample | None
    ) -> tuple[Sample, RewardResult | None]:
        """The session's trajectory and reward (None when a freeze cancelled it: an empty partial sample)."""
        if partial is not None:
            self.turns.stats["env/agent_restarted"] += 1  # a frozen session starts again
        sid = f"{prompt.uid}-{uuid.uuid4().hex[:12]}"
        settings = {
            "temperature": req.temperature,
            "top_p": req.top_p,
            "max_tokens": req.max_tokens,
            "seed": req.seed,
            "max_calls": self.max_calls,
        }
        await asyncio.wait_for(self.frontend.open_session.remote(sid, settings), CALL_TIMEOUT_S)
        row = {"uid": prompt.uid, "prompt": prompt.prompt_text, "answer": prompt.answer}
        row["data_source"] = prompt.data_source
        t0 = time.perf_counter()
        err: AgentError | None = None
        reward: tuple[float, dict[str, float]] = (0.0, {})
        try:
            reward = await self._agent(f"{self.base}/s/{sid}/v1", row)
        except AgentError as e:
            err = e
        finally:
            calls: list[SessionCall] = await asyncio.wait_for(
                self.frontend.take_session.remote(sid), CALL_TIMEOUT_S
            )
        if self.turns.freezing and err is not None and err.kind == "frozen":
            return Sample(token_ids=[], logprobs=[], versions=[], finish_reason="abort"), None
        try:
            traj = assemble(prompt.prompt_ids, calls)
        except Inconsistent as e:
            traj, err = e.traj, err or AgentError("inconsistent", str(e))
        traj.env_s = max(0.0, time.perf_counter() - t0 - sum(c.seconds for c in calls))
        self.turns.stats["env/step_s_sum"] += traj.env_s
        self.turns.stats["env/steps"] += 1
        finish = calls[-1].finish_reason if calls and err is None else "stop"
        if err is not None:
            self.turns.stats[f"env/errors_{err.kind}"] += 1
            log.warning("agent session %s failed: %s", sid, err.detail)
            return traj.sample(finish), RewardResult(
                score=self.on_error, error=f"env_{err.kind}", detail=err.detail
            )
        score, extras = reward
        traj.tool_calls = int(extras.pop("tool_calls", 0))
        return traj.sample(finish), RewardResult(score=score, extras=extras)

    async def _agent(self, base_url: str, row: dict[str, Any]) -> tuple[float, dict[str, float]]:
        """The agent's reward (`agent_reward`); raises AgentError (timeout, exception, invalid, or frozen by
        a checkpoint)."""
        task = asyncio.ensure_future(self._call(base_url, row))
        deadline = time.monotonic() + self.timeout_s
        try:
            while not task.done():
                if self.turns.freezing:
                    raise AgentError("frozen", "a checkpoint froze the rollout")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AgentError("timeout", f"the agent took over env.agent_timeout_s={self.timeout_s}s")
                await asyncio.wait({task}, timeout=min(FREEZE_POLL_S, left))
            value = task.result()
        except AgentError:
            raise
        except Exception as e:
            raise AgentError("exception", f"the agent raised {type(e).__name__}: {e}") from e
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        return agent_reward(value)

    async def _call(self, base_url: str, row: dict[str, Any]) -> Any:
        fn = self.agent
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):
            return await fn(base_url, row)
        out = await asyncio.to_thread(fn, base_url, row)  # a blocking agent runs in a thread
        return await out if inspect.isawaitable(out) else out


def _finite(v: Any) -> bool:
    return isinstance(v, numbers.Real) and math.isfinite(v)


def agent_reward(value: Any) -> tuple[float, dict[str, float]]:
    """(score, extras) of what an agent returned: a finite number, or a dict with a finite "score" and other
    numeric entries (sub-scores, logged as reward/sub/*; "tool_calls", the session's tool calls, is counted
    as env/tool_calls). Raises AgentError("invalid") for anything else."""
    if isinstance(value, dict) and _finite(value.get("score")):
        return float(value["score"]), {
            str(k): float(v) for k, v in value.items() if k != "score" and _finite(v)
        }
    if not _finite(value):
        raise AgentError(
            "invalid", f"the agent returned {value!r:.100}: not a finite number, nor a dict with a 'score'"
        )
    return float(value), {}
