"""One prompt's GRPO group: generate its samples through a `GenerateFn`, score each as it finishes.

A group is one request for its `n` samples (`rollout.group_requests`), or each sample is its own request,
whose reward then starts the moment it finishes while the rest of the group is still generating (a group
request's samples, finished together, a fast reward scores in one call: `EachScore`). A reward
that sees a whole group at once (TRL's batched functions: a `GroupScore` says which) scores the group in one
call when its last sample finishes. Where generation runs is behind `GenerateFn` (an async callable taking a
`GenerateRequest` and returning a `GenerateResponse` with `n` samples): in production a thin wrapper over the
Serve handle, in tests a fake.

Partial rollouts (`rollout.partial`, asked through its policy, app/rollout/partial.py): with `keep` and `off`
the replica handles a push itself (`off` also regenerates a group's samples older than its newest); with
`resubmit` a sample aborted by a push comes back with finish reason 'abort' and goes out again as prompt +
partial response until it finishes (`admission.merge_partial`: every token keeps its version and log-prob).
`freezing` (a checkpoint's clean stop) ends this: a group with an aborted sample raises `Frozen` carrying its
samples so far, which the snapshot saves and a restored run continues.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Protocol, runtime_checkable

from app.config import EnvConfig, RewardConfig, RolloutConfig, parse_lengths
from app.envs.base import EnvFactory, EpisodeMaker, EpisodeRunner
from app.records import GenerateRequest, GenerateResponse, Group, Prompt, Sample
from app.rewards import RewardResult, overlong_penalty
from app.rewards.styles import RewardInput
from app.rollout import admission
from app.rollout.episode import Episode
from app.rollout.partial import partial_policy

log = logging.getLogger(__name__)

MAX_RESUBMITS = 100


class GenerateFn(Protocol):
    """`req.n` samples of `req.prompt_ids` (a seeded request's sample i as a request seeded `req.seed + i`
    would give it: a group's one request then matches its per-sample requests)."""

    async def __call__(self, req: GenerateRequest) -> GenerateResponse: ...


ScoreFn = Callable[[RewardInput], Awaitable[RewardResult]]  # one sample and its row -> its reward


@runtime_checkable
class GroupScore(Protocol):
    """The reward stage (app/rewards/pool.py `RewardPool`): scores a sample, or, where `batched` says so for
    a data source (a TRL-style function), a whole group of one row's samples in one call."""

    async def score(self, inp: RewardInput) -> RewardResult: ...

    async def batched(self, data_source: str) -> bool: ...

    async def score_group(self, inps: list[RewardInput]) -> list[RewardResult]: ...


@runtime_checkable
class EachScore(Protocol):
    """A reward stage that may score the samples of a group that finish together in one call (app/rewards/
    pool.py `RewardPool`: a fast reward, one request to its scoring process for all of them)."""

    def fast(self) -> bool: ...

    async def score_each(self, inps: list[RewardInput]) -> list[RewardResult]: ...


class RefFill(Protocol):
    async def fill(self, group: Group) -> None: ...


class Frozen(Exception):
    """A group whose generation a checkpoint's freeze ended: `samples` are kept as a partial rollout."""

    def __init__(self, key: str, samples: list[Sample]) -> None:
        super().__init__(key)
        self.key, self.samples = key, samples


class GroupGenerator:
    """Generates and scores groups; `inflight` holds the keys of groups generating now. It is the `Turns`
    (app/envs/base.py) its episodes generate their model turns through."""

    def __init__(
        self,
        generate: GenerateFn,
        decode: Callable[[list[int]], str],
        score: ScoreFn | GroupScore,
        rollout: RolloutConfig,
        *,
        reward: RewardConfig,
        seed: int,
        refs: RefFill | None = None,
        stats: Counter[str] | None = None,
        env: EnvFactory | EpisodeMaker | None = None,
        encode: Callable[[str], list[int]] | None = None,
        limits: EnvConfig | None = None,
    ) -> None:
        """Sampling from `rollout`, DAPO's overlong shaping and a failed episode's score from `reward`, the
        run's `seed` (long-tailed lengths). `env`: a factory of environments (app/envs): each sample is then
        a multi-turn episode (app/rollout/episode.py) whose reward the environment gives, bounded by
        `limits` (the config's `env` section); `encode` tokenizes its observations. `score` scores a sample,
        or is a `GroupScore` that may score a whole group at once."""
        self.generate, self._decode = generate, decode
        self.groups = score if isinstance(score, GroupScore) else None
        self.each = score if isinstance(score, EachScore) else None
        self.score: ScoreFn = score.score if isinstance(score, GroupScore) else score
        self.rollout, self.reward, self.seed = rollout, reward, seed
        self.partial = partial_policy(rollout.partial)
        self.lengths = parse_lengths(rollout.lengths)
        self.refs, self._encode = refs, encode
        self.episode: EpisodeRunner | None = None
        if env is not None:
            if encode is None or limits is None:
                raise ValueError(
                    "a multi-turn generator needs `encode` to tokenize the environment's observations and "
                    "`limits` (the config's `env` section) to bound its episodes"
                )
            self.episode = (
                env.make_episode(self, limits, reward.on_error)  # it runs whole episodes itself (agents)
                if isinstance(env, EpisodeMaker)
                else Episode(self, env, limits, reward.on_error)
            )
        self.stats: Counter[str] = stats if stats is not None else Counter()
        self.inflight: set[str] = set()
        self.freezing = False

    async def group(
        self,
        prompt: Prompt,
        *,
        seed: int | None,
        n: int | None = None,
        temperature: float | None = None,
        train: bool = True,
        score_now: bool = True,
    ) -> Group:
        """One prompt's group of `n` samples (a restored prompt continues its partial samples). Rewards
        are scored as each sample finishes unless `score_now` is false (then call `score_group`)."""
        r = self.rollout
        temp = r.temperature if temperature is None else temperature
        req = GenerateRequest(
            prompt_ids=list(prompt.prompt_ids),
            max_tokens=admission.response_budget(self.lengths, prompt.uid, self.seed, r.max_tokens),
            temperature=temp,
            top_p=r.top_p if temp > 0 else 1.0,
            top_k=r.top_k if temp > 0 else 0,
            stop=list(r.stop),
            seed=seed,
            ignore_eos=r.ignore_eos,
            logprobs=r.behaviour_logprobs == "engine",
        )
        key = prompt.key if train else f"val:{prompt.uid}"
        if prompt.partial:
            self.stats["ckpt/resumed_partial_groups"] += 1
        count = len(prompt.partial) if prompt.partial else (n or self.rollout.n)
        reqs = [replace(req, seed=None if seed is None else seed + i) for i in range(count)]
        whole = score_now and await self._batched(prompt)  # scored as a group once all are generated
        self.inflight.add(key)
        try:
            outs = await self._samples(prompt, req, reqs, score_now and not whole)
            if self.partial.one_version_groups and self.episode is None and not prompt.partial:
                outs = await self._one_version(prompt, reqs, outs, score_now and not whole)
        finally:
            self.inflight.discard(key)
        if train and self.freezing and any(s.finish_reason == "abort" for s, _ in outs):
            raise Frozen(key, [s for s, _ in outs])
        if whole:
            outs = await score_whole(self.groups, prompt, self.freezing, outs)
        for s, res in outs:
            self._set_reward(s, res, shape=train)
        g = Group(
            uid=prompt.uid,
            prompt_ids=list(prompt.prompt_ids),
            answer=prompt.answer,
            samples=[s for s, _ in outs],
            epoch=prompt.epoch,
            prompt_text=prompt.prompt_text,
            data_source=prompt.data_source,
            chat=prompt.chat,
            extra_info=dict(prompt.extra_info),
            truth=prompt.truth,
            columns=dict(prompt.columns),
        )
        if train and score_now and self.refs is not None:
            await self.refs.fill(g)
        return g

    async def _one_version(
        self,
        prompt: Prompt,
        reqs: list[GenerateRequest],
        outs: list[tuple[Sample, RewardResult | None]],
        score_now: bool,
    ) -> list[tuple[Sample, RewardResult | None]]:
        """`rollout.partial=off`: every sample of a group comes from one policy version. The replica drains
        before a push, but each sample is its own request: one still on its way to the replica when the push
        closes its gate, or one served by a replica the push reached earlier, runs under the newer weights.
        The samples older than the group's newest are generated again (counted in `async/off_regenerated`),
        until all agree; past `rollout.request_timeout_s` the group fails and its prompt goes back to the
        stream. (Restored partial samples and multi-turn episodes are left as they are.)"""
        timeout_s = self.rollout.request_timeout_s
        deadline = time.monotonic() + timeout_s
        while stale := admission.older_than_newest([s for s, _ in outs]):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"prompt {prompt.uid}: pushes kept landing between its samples for "
                    f"rollout.request_timeout_s={timeout_s}s, so its group never came from one "
                    "policy version (rollout.partial=off); push less often or use rollout.partial=keep"
                )
            self.stats["async/off_regenerated"] += len(stale)
            again = await asyncio.gather(*[self._sample(prompt, reqs[i], None, score_now) for i in stale])
            for i, out in zip(stale, again, strict=True):
                outs[i] = out
        return outs

    def _set_reward(self, s: Sample, res: RewardResult | None, shape: bool = True) -> None:
        """The sample's reward; training samples (`shape`) also get the overlong punishment, if on."""
        if res is None:
            s.reward, s.reward_error, s.reward_extras, s.reward_scores = 0.0, "unscored", {}, {}
            return
        if res.error and not res.error.startswith("env_"):  # an environment's are counted as env/errors_*
            self.stats[f"reward/errors_{res.error}"] += 1
        if getattr(res, "output_dropped", 0):  # what the reward printed past the scoring process's cap
            self.stats["reward/output_dropped_bytes"] += res.output_dropped
        s.reward, s.reward_error, s.reward_extras = res.score, res.error, dict(res.extras or {})
        s.reward_scores = dict(getattr(res, "scores", None) or {})
        if shape and self.reward.overlong_buffer > 0:
            pen = overlong_penalty(
                len(s.token_ids),
                self.rollout.max_tokens,
                self.reward.overlong_buffer,
                self.reward.overlong_factor,
            )
            s.reward += pen
            s.reward_extras["overlong_penalty"] = pen

    async def score_group(self, g: Group) -> Group:
        """Score a group generated with score_now=False (reward.overlap=false: after the whole batch).
        Episodes were scored by their environment as they finished."""
        if self.episode is not None:
            if self.refs is not None:
                await self.refs.fill(g)
            return g
        prompt = g.prompt()
        if await self._batched(prompt):
            outs = await score_whole(self.groups, prompt, False, [(s, None) for s in g.samples])
            results = [res for _, res in outs]
        else:
            results = await asyncio.gather(*[self.score(RewardInput.of(prompt, s.text)) for s in g.samples])
        for s, res in zip(g.samples, results, strict=True):
            self._set_reward(s, res)
        if self.refs is not None:
            await self.refs.fill(g)
        return g

    async def _batched(self, prompt: Prompt) -> bool:
        """Whether `prompt`'s samples are scored as one group (see `GroupScore`); never for episodes."""
        return (
            self.episode is None and self.groups is not None and await self.groups.batched(prompt.data_source)
        )

    async def _samples(
        self, prompt: Prompt, req: GenerateRequest, reqs: list[GenerateRequest], score_now: bool
    ) -> list[tuple[Sample, RewardResult | None]]:
        """The group's samples, each scored as it finishes (or, with `rollout.group_requests`, as the group
        does): one request per sample, or one for the whole group, whose replica seeds its sample i as
        `reqs[i]` would be (`req.seed + i`). Episodes and restored partial samples go one by one."""
        if self.rollout.group_requests and self.episode is None and not prompt.partial:
            resp = await self._request(prompt.uid, replace(req, n=len(reqs)))
            if len(resp.samples) != len(reqs):
                raise RuntimeError(
                    f"prompt {prompt.uid}: a group request for {len(reqs)} samples got "
                    f"{len(resp.samples)} from replica {resp.replica!r}"
                )
            for s in resp.samples:
                s.replica = s.replica or resp.replica
            # they finish together: a fast reward scores them in one call (none is continued after a push)
            together = score_now and self.each is not None and not self.partial.resubmits and self.each.fast()
            outs = await asyncio.gather(
                *[
                    self._finish(prompt, r, s, score_now and not together)
                    for r, s in zip(reqs, resp.samples, strict=True)
                ]
            )
            return await self._score_together(prompt, list(outs)) if together else list(outs)
        partial = prompt.partial
        return list(
            await asyncio.gather(
                *[
                    self._sample(prompt, r, replace(partial[i]) if partial else None, score_now)
                    for i, r in enumerate(reqs)
                ]
            )
        )

    async def _score_together(
        self, prompt: Prompt, outs: list[tuple[Sample, RewardResult | None]]
    ) -> list[tuple[Sample, RewardResult | None]]:
        """A group's finished samples scored in one `score_each` call (one a freeze left aborted unscored)."""
        assert self.each is not None
        done = [i for i, (s, _) in enumerate(outs) if not (self.freezing and s.finish_reason == "abort")]
        results = await self.each.score_each([RewardInput.of(prompt, outs[i][0].text) for i in done])
        for i, res in zip(done, results, strict=True):
            outs[i] = (outs[i][0], res)
        return outs

    async def _sample(
        self, prompt: Prompt, req: GenerateRequest, sample: Sample | None, score_now: bool
    ) -> tuple[Sample, RewardResult | None]:
        """Generate (or continue) one sample, then score it at once: (sample, reward or None)."""
        if self.episode is not None:
            sample, res = await self.episode.run(prompt, req, sample)
            sample.text = self.decode(sample.token_ids)
            return sample, res
        if sample is None:
            resp = await self._request(prompt.uid, req)
            sample = resp.samples[0]
            sample.replica = sample.replica or resp.replica
        return await self._finish(prompt, req, sample, score_now)

    async def _finish(
        self, prompt: Prompt, req: GenerateRequest, sample: Sample, score_now: bool
    ) -> tuple[Sample, RewardResult | None]:
        """A generated sample: continued while a push aborted it (`resubmit`), decoded, scored now or later."""
        if self.partial.resubmits or sample.finish_reason == "abort":
            sample = await self._complete(req, sample)
        if self.freezing and sample.finish_reason == "abort":
            return sample, None
        sample.text = self.decode(sample.token_ids)
        if not score_now:
            return sample, None
        return sample, await self.score(RewardInput.of(prompt, sample.text))

    async def turn(self, uid: str, req: GenerateRequest) -> Sample:
        """One sample of `req` (an episode's model turn; `Turns.turn`, app/envs/base.py): requested, then
        continued while a push aborted it (`resubmit`)."""
        resp = await self._request(uid, req)
        s = resp.samples[0]
        s.replica = s.replica or resp.replica
        if self.partial.resubmits or s.finish_reason == "abort":
            s = await self._complete(req, s)
        return s

    def decode(self, ids: list[int]) -> str:
        return self._decode(ids)

    def encode(self, text: str) -> list[int]:
        """An environment's observation as tokens (multi-turn generators only: they are given `encode`)."""
        if self._encode is None:
            raise RuntimeError("this generator runs no episodes: it was given no `encode`")
        return self._encode(text)

    async def _request(self, uid: str, req: GenerateRequest) -> GenerateResponse:
        """One generation within `rollout.request_timeout_s`. A replica or engine that died is retried on a
        live one by the `GenerateFn` itself (app/rollout/serve_generate.py: within the same deadline);
        what still fails here fails the group, whose prompt goes back to the stream."""
        timeout_s = self.rollout.request_timeout_s
        try:
            return await asyncio.wait_for(self.generate(req), timeout=timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"generation for prompt {uid} took over rollout.request_timeout_s={timeout_s}s"
            ) from None
        except Exception as e:
            self.stats["rollout/request_failures"] += 1
            raise RuntimeError(f"rollout failed for prompt {uid}: {e}") from e

    async def _complete(self, req: GenerateRequest, sample: Sample) -> Sample:
        """A sample aborted by a push goes back as prompt + partial response until it finishes; its
        earlier tokens keep their versions and behaviour log-probs."""
        rounds = 0
        while (
            sample.finish_reason == "abort" and len(sample.token_ids) < req.max_tokens and not self.freezing
        ):
            rounds += 1
            if rounds > MAX_RESUBMITS:
                raise RuntimeError(
                    f"a sample was aborted by {MAX_RESUBMITS} pushes in a row; is generation progressing?"
                )
            self.stats["async/resubmitted"] += 1
            cont = replace(
                req,
                prompt_ids=req.prompt_ids + sample.token_ids,
                n=1,
                max_tokens=req.max_tokens - len(sample.token_ids),
                seed=None,
            )
            resp = await asyncio.wait_for(self.generate(cont), timeout=self.rollout.request_timeout_s)
            sample = admission.merge_partial(sample, resp.samples[0])
        return sample


async def score_whole(
    groups: GroupScore | None, prompt: Prompt, freezing: bool, outs: list[tuple[Sample, RewardResult | None]]
) -> list[tuple[Sample, RewardResult | None]]:
    """A group's generated samples `outs` scored in one call (a sample a freeze left aborted stays unscored)."""
    assert groups is not None
    done = [i for i, (s, _) in enumerate(outs) if not (freezing and s.finish_reason == "abort")]
    if not done:
        return outs
    results = await groups.score_group([RewardInput.of(prompt, outs[i][0].text) for i in done])
    scored = list(outs)
    for i, res in zip(done, results, strict=True):
        scored[i] = (outs[i][0], res)
    return scored
