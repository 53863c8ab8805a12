"""One multi-turn episode: the model's turns and an environment's answers, as one trajectory.

The trajectory is a `Sample` whose tokens interleave model turns (loss mask 1, the behaviour log-prob and
policy version of each token as sampled) and environment observations (loss mask 0, log-prob 0, the
version of the nearest model token, so staleness still counts the oldest model token). Each turn is one
generation request of prompt + trajectory so far, so partial rollouts work per turn: a push mid-turn is
kept (`keep`) or the turn resubmitted (`resubmit`: the generator's `Turns.turn`), and a
checkpoint's freeze ends the episode as a partial sample that a restored run continues (the environment's
state is rebuilt by replaying its steps on the finished model turns: app/envs/base.py).

Limits: `env.max_turns` model turns, `env.max_total_tokens` response tokens (model and environment), a
per-call deadline `env.step_timeout_s`. An environment that raises or hangs ends the episode with
`reward.on_error` and is counted as `env/errors_exception` / `env/errors_timeout`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field, replace
from typing import TypeVar

from app.config import EnvConfig
from app.envs.base import EnvFactory, Environment, EnvStep, Turns
from app.records import GenerateRequest, Prompt, Sample
from app.rewards import RewardResult

log = logging.getLogger(__name__)
T = TypeVar("T")


class EnvError(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind, self.detail = kind, detail


@dataclass
class Trajectory:
    """Tokens so far with their log-probs, versions (None on environment tokens until `sample()`) and mask."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    env_s: float = 0.0
    replica: str = ""

    @classmethod
    def of(cls, s: Sample) -> Trajectory:
        mask = list(s.loss_mask) if s.loss_mask is not None else [1] * len(s.token_ids)
        vers: list[int | None] = [v if m else None for v, m in zip(s.versions, mask, strict=True)]
        return cls(list(s.token_ids), list(s.logprobs), vers, mask, s.turns, s.tool_calls, s.env_s, s.replica)

    def add_model(self, s: Sample) -> None:
        self.tokens += s.token_ids
        self.logprobs += s.logprobs
        self.versions += s.versions
        self.mask += [1] * len(s.token_ids)
        self.replica = self.replica or s.replica

    def add_env(self, ids: list[int]) -> None:
        self.tokens += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [None] * len(ids)
        self.mask += [0] * len(ids)

    def model_runs(self) -> list[tuple[int, int]]:
        """[start, end) spans of the model's turns."""
        return mask_runs(self.mask)

    def sample(self, finish_reason: str) -> Sample:
        return Sample(
            token_ids=list(self.tokens),
            logprobs=list(self.logprobs),
            versions=_fill_versions(self.versions),
            finish_reason=finish_reason,
            loss_mask=list(self.mask),
            turns=self.turns,
            tool_calls=self.tool_calls,
            env_s=self.env_s,
            replica=self.replica,
        )


def mask_runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) spans of the 1s of a loss mask (the model's turns of a trajectory)."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _fill_versions(vers: list[int | None]) -> list[int]:
    """Environment tokens take the version of the model token before them (after, at the start)."""
    out: list[int] = []
    last = next((v for v in vers if v is not None), -1)
    for v in vers:
        last = v if v is not None else last
        out.append(last)
    return out


class Episode:
    """Runs one sample's episode through the generator's `Turns` (model turns, decode/encode, stats),
    bounded by the config's `env` section (`lim`); a failed one scores `on_error` (`reward.on_error`)."""

    def __init__(self, turns: Turns, factory: EnvFactory, env: EnvConfig, on_error: float) -> None:
        self.turns, self.factory, self.lim, self.on_error = turns, factory, env, on_error

    async def run(
        self, prompt: Prompt, req: GenerateRequest, partial: Sample | None
    ) -> tuple[Sample, RewardResult | None]:
        """The episode's trajectory and reward (None when a freeze ended it: a partial sample)."""
        env = self.factory()
        traj = Trajectory.of(partial) if partial is not None else Trajectory()
        try:
            first = await self._call(env.reset(prompt), "reset", traj)
            if partial is None:
                traj.add_env(self._encode(first, traj))
            else:
                await self._replay(env, traj)
            return await self._turns(env, prompt, req, traj)
        except EnvError as e:
            self.turns.stats[f"env/errors_{e.kind}"] += 1
            log.warning("environment failed on prompt %s: %s", prompt.uid, e.detail)
            return traj.sample("stop"), RewardResult(
                score=self.on_error, error=f"env_{e.kind}", detail=e.detail
            )

    async def _replay(self, env: Environment, traj: Trajectory) -> None:
        """A restored partial episode: step the environment again on each finished model turn."""
        runs = traj.model_runs()
        finished = runs if traj.mask and not traj.mask[-1] else runs[:-1]
        for a, b in finished:
            await self._call(env.step(self.turns.decode(traj.tokens[a:b])), "step", traj)

    async def _turns(
        self, env: Environment, prompt: Prompt, req: GenerateRequest, traj: Trajectory
    ) -> tuple[Sample, RewardResult | None]:
        """Model turn, environment step, until done or a limit; the reward is the last step's."""
        step = EnvStep()
        while traj.turns < self.lim.max_turns:
            room = self.lim.max_total_tokens - len(traj.tokens)
            if room <= 0:
                break
            resuming = bool(traj.mask) and traj.mask[-1] == 1  # a turn a freeze cut short continues
            start = traj.model_runs()[-1][0] if resuming else len(traj.tokens)
            budget = min(req.max_tokens - (len(traj.tokens) - start), room)
            turn = await self._generate(req, prompt, traj, budget)
            traj.add_model(turn)
            if turn.finish_reason == "abort" and self.turns.freezing:
                return traj.sample("abort"), None
            traj.turns += 1
            step = await self._call(env.step(self.turns.decode(traj.tokens[start:])), "step", traj)
            traj.tool_calls += int(step.tool_call)
            if step.done:
                return traj.sample("stop"), self._result(step)
            traj.add_env(self._encode(step.observation, traj))
        return traj.sample("length"), self._result(step)

    async def _generate(
        self, req: GenerateRequest, prompt: Prompt, traj: Trajectory, max_tokens: int
    ) -> Sample:
        """One model turn (continued where a freeze cut it), through the generator's `Turns.turn`."""
        cont = replace(
            req,
            prompt_ids=list(prompt.prompt_ids) + traj.tokens,
            max_tokens=max_tokens,
            n=1,
            seed=None if req.seed is None else req.seed + 7919 * (traj.turns + 1),
        )
        return await self.turns.turn(prompt.uid, cont)

    async def _call(self, coro: Awaitable[T], what: str, traj: Trajectory) -> T:
        t0 = time.perf_counter()
        try:
            return await asyncio.wait_for(coro, timeout=self.lim.step_timeout_s)
        except asyncio.TimeoutError:
            raise EnvError(
                "timeout", f"{what} took over env.step_timeout_s={self.lim.step_timeout_s}s"
            ) from None
        except Exception as e:
            raise EnvError("exception", f"{what} raised {type(e).__name__}: {e}") from e
        finally:
            dt = time.perf_counter() - t0
            traj.env_s += dt
            self.turns.stats["env/step_s_sum"] += dt
            self.turns.stats["env/steps"] += 1

    def _encode(self, text: str, traj: Trajectory) -> list[int]:
        """An observation's tokens, cut to what the total token budget leaves."""
        ids = self.turns.encode(text) if text else []
        return ids[: max(0, self.lim.max_total_tokens - len(traj.tokens))]

    @staticmethod
    def _result(step: EnvStep) -> RewardResult:
        return RewardResult(score=float(step.reward), extras=dict(step.extras))


def env_metrics(samples: list[Sample]) -> dict[str, float]:
    """Multi-turn episodes' turns and tool calls per sample, environment seconds per turn, and the share of
    response tokens the environment wrote (none when no sample is an episode)."""
    eps = [s for s in samples if s.turns > 0]
    if not eps:
        return {}
    turns = sum(s.turns for s in eps)
    tokens = sum(len(s.token_ids) for s in eps)
    return {
        "env/turns_mean": turns / len(eps),
        "env/tool_calls": sum(s.tool_calls for s in eps) / len(eps),
        "env/tool_call_rate": sum(1 for s in eps if s.tool_calls) / len(eps),
        "env/step_s": sum(s.env_s for s in eps) / max(1, turns),
        "env/token_share": (tokens - sum(s.model_tokens for s in eps)) / max(1, tokens),
    }
