"""The rollout pipeline's parts without Ray: the prompt stream (exactly-once across epochs, retries, restore
mid-epoch, overlong counting) and the group generator (partial rollouts, freeze, rewards) on a fake
generation."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter

import pytest

from app.config import RewardConfig, RolloutConfig, load_config, typed
from app.records import GenerateRequest, GenerateResponse, Group, PipelineSnapshot, Prompt, Sample
from app.rewards import RewardResult
from app.rewards.styles import RewardInput
from app.rollout import Frozen, GroupGenerator, PromptStream
from app.rollout.producer import reward_errors
from app.rollout.prompt_files import DataError


def _rows(n: int, long: set[int] = frozenset()):
    prompts = [Prompt(uid=f"p{i}", prompt_ids=[1] * (9 if i in long else 2), answer="a") for i in range(n)]

    def epoch_rows(epoch: int):
        order = list(prompts)
        random.Random(epoch).shuffle(order)
        return iter(order)

    return epoch_rows


def _group(p: Prompt) -> Group:
    s = Sample(token_ids=[1], logprobs=[0.0], versions=[0], finish_reason="stop")
    return Group(uid=p.uid, prompt_ids=p.prompt_ids, answer=p.answer, samples=[s], epoch=p.epoch)


def test_stream_exactly_once_across_epochs_with_retries():
    stream = PromptStream(_rows(5), epochs=3)
    seen: list[tuple[str, int]] = []
    while True:
        got = stream.take(2)
        if not got:
            break
        for p in got:
            if p.uid == "p3" and p.epoch == 1 and ("p3", 1, "retried") not in seen:
                seen.append(("p3", 1, "retried"))
                stream.retry(p)  # failed once: handed out again before any fresh prompt
                continue
            seen.append((p.uid, p.epoch))
        stream.ack([f"{p.epoch}:{p.uid}" for p in got if (p.uid, p.epoch) in seen])
    trained = [s for s in seen if len(s) == 2]
    assert Counter(trained) == Counter((f"p{i}", e) for i in range(5) for e in range(3))
    assert stream.exhausted and not stream.outstanding and stream.cursor == 15


def test_stream_restore_mid_epoch_trains_each_prompt_once():
    stream = PromptStream(_rows(6), epochs=2)
    first = stream.take(4)  # 0: trained; 1: finished, not trained; 2-3: generating at the checkpoint
    stream.ack([first[0].key])
    part = Sample(token_ids=[7], logprobs=[-1.0], versions=[0], finish_reason="abort")
    stream.keep_partial(first[3].key, [part])
    snap = stream.snapshot([_group(first[1])])
    snap = PipelineSnapshot.from_dict(json.loads(json.dumps(snap.to_dict())))  # through pipeline.json
    assert [p.uid for p in snap.pending] == [first[2].uid, first[3].uid]
    assert snap.partial_groups == 1 and snap.partial_tokens == 1

    resumed = PromptStream(_rows(6), epochs=2)
    resumed.restore(snap)
    again = resumed.take(2)  # the pending prompts first, the frozen one with its partial samples
    assert [p.uid for p in again] == [first[2].uid, first[3].uid] and again[1].partial == [part]
    rest = []
    while got := resumed.take(3):
        rest += got
    trained = [first[0], first[1], *again, *rest]
    assert Counter((p.uid, p.epoch) for p in trained) == Counter(
        (f"p{i}", e) for i in range(6) for e in range(2)
    )
    assert resumed.take(1, generation=0) == []  # a request from before the restore gets nothing


def test_stream_counts_overlong_and_fails_without_usable_prompts():
    stream = PromptStream(_rows(4, long={1, 2}), epochs=1, max_prompt_tokens=4)
    got = stream.take(10)
    assert sorted(p.uid for p in got) == ["p0", "p3"] and stream.dropped_overlong == 2
    with pytest.raises(DataError, match="no usable prompt"):
        PromptStream(_rows(2, long={0, 1}), max_prompt_tokens=4).take(1)


class FakeReplica:
    """A `GenerateFn`: `abort_first` requests end with 'abort' after one token (a push under resubmit)."""

    def __init__(self, abort_first: int = 0, version: int = 0) -> None:
        self.abort_left, self.version, self.calls = abort_first, version, []

    async def __call__(self, req: GenerateRequest) -> GenerateResponse:
        self.calls.append(req)
        await asyncio.sleep(0)
        if self.abort_left > 0:
            self.abort_left -= 1
            k, reason = 1, "abort"
        else:
            k, reason = req.max_tokens, "length"
        smp = Sample(
            token_ids=[5] * k, logprobs=[-0.1] * k, versions=[self.version] * k, finish_reason=reason
        )
        self.version += 1
        return GenerateResponse(samples=[smp], replica="r0", version=self.version)


async def _score(inp: RewardInput) -> RewardResult:
    return RewardResult(
        score=float(len(inp.response.split())), error="timeout" if inp.answer == "bad" else None
    )


class SeededReplica:
    """A `GenerateFn` by the protocol's contract: a seeded request for `n` samples answers sample i as a
    request seeded `seed + i` would (its tokens: that seed, `max_tokens` times); `short` drops one sample."""

    def __init__(self, short: bool = False) -> None:
        self.calls: list[GenerateRequest] = []
        self.short = short

    async def __call__(self, req: GenerateRequest) -> GenerateResponse:
        self.calls.append(req)
        await asyncio.sleep(0)
        k = req.n - 1 if self.short else req.n
        samples = [
            Sample(
                token_ids=[req.seed + i] * req.max_tokens,
                logprobs=[-0.5] * req.max_tokens,
                versions=[3] * req.max_tokens,
                finish_reason="length",
            )
            for i in range(k)
        ]
        return GenerateResponse(samples=samples, replica="r1", version=3)


def _gen(fake: FakeReplica | SeededReplica, reward: RewardConfig | None = None, **kw) -> GroupGenerator:
    """A generator over `fake` (`kw`: `rollout.*`); one request per sample unless `group_requests=True`
    (FakeReplica answers one sample a request: these tests drive the per-sample mechanics, resubmits,
    freezes, regenerations)."""
    kw.setdefault("group_requests", False)
    return GroupGenerator(
        fake,
        lambda ids: " ".join(map(str, ids)),
        _score,
        RolloutConfig(n=2, max_tokens=4, **kw),
        reward=reward or RewardConfig(),
        seed=0,
    )


def test_group_requests_send_one_request_a_group_with_the_same_samples():
    prompt = Prompt(uid="u", prompt_ids=[1, 2], answer="a")
    per_sample, grouped = SeededReplica(), SeededReplica()
    one = asyncio.run(_gen(per_sample).group(prompt, seed=10, n=3))
    whole = asyncio.run(_gen(grouped, group_requests=True).group(prompt, seed=10, n=3))
    assert [(r.n, r.seed) for r in per_sample.calls] == [(1, 10), (1, 11), (1, 12)]
    assert [(r.n, r.seed) for r in grouped.calls] == [(3, 10)]  # one request, its base seed
    assert (
        [s.token_ids for s in whole.samples]
        == [s.token_ids for s in one.samples]
        == [[10] * 4, [11] * 4, [12] * 4]
    )
    assert [s.reward for s in whole.samples] == [4.0] * 3  # each sample scored
    assert all(s.replica == "r1" for s in whole.samples)
    with pytest.raises(RuntimeError, match="a group request for 3 samples got 2 from replica 'r1'"):
        asyncio.run(_gen(SeededReplica(short=True), group_requests=True).group(prompt, seed=10, n=3))


def test_generator_resubmit_merges_partial_and_scores():
    fake = FakeReplica(abort_first=2)
    gen = _gen(fake, partial="resubmit")
    g = asyncio.run(gen.group(Prompt(uid="u", prompt_ids=[1, 2], answer="bad"), seed=3))
    assert len(g.samples) == 2 and all(len(s.token_ids) == 4 for s in g.samples)
    assert all(s.reward == 4.0 and s.reward_error == "timeout" for s in g.samples)
    assert gen.stats["async/resubmitted"] == 2 and gen.stats["reward/errors_timeout"] == 2
    conts = [r for r in fake.calls if len(r.prompt_ids) == 3]  # prompt + the aborted token
    assert len(conts) == 2 and all(r.max_tokens == 3 and r.seed is None for r in conts)
    assert all(s.versions[0] < s.versions[1] for s in g.samples)  # tokens keep their own versions


def test_reward_output_past_the_cap_is_counted():
    async def chatty(inp: RewardInput) -> RewardResult:
        return RewardResult(score=1.0, output_dropped=10_000)

    gen = GroupGenerator(
        FakeReplica(),
        lambda ids: " ".join(map(str, ids)),
        chatty,
        RolloutConfig(n=2, max_tokens=4, group_requests=False),
        reward=RewardConfig(),
        seed=0,
    )
    g = asyncio.run(gen.group(Prompt(uid="u", prompt_ids=[1, 2], answer="a"), seed=3))
    assert all(s.reward == 1.0 for s in g.samples)
    assert gen.stats["reward/output_dropped_bytes"] == 20_000
    assert reward_errors(gen.stats) == {"reward/output_dropped_bytes": 20_000}  # logged with the batch


def test_generator_freeze_and_continue_partial():
    fake = FakeReplica(abort_first=2)
    gen = _gen(fake, partial="keep")
    gen.freezing = True
    with pytest.raises(Frozen) as e:
        asyncio.run(gen.group(Prompt(uid="u", prompt_ids=[1], answer="a", epoch=1), seed=0))
    assert e.value.key == "1:u" and [len(s.token_ids) for s in e.value.samples] == [1, 1]
    gen.freezing = False  # a restored run continues the partial samples
    p = Prompt(uid="u", prompt_ids=[1], answer="a", epoch=1, partial=e.value.samples)
    g = asyncio.run(gen.group(p, seed=0))
    assert [len(s.token_ids) for s in g.samples] == [4, 4] and gen.stats["ckpt/resumed_partial_groups"] == 1
    assert not gen.inflight


def test_off_regenerates_the_samples_a_push_overtook_until_the_group_has_one_version():
    """rollout.partial=off: the first sample is served at v0, then a push lands before the second reaches
    the replica (v1). The older sample is generated again, with its own seed, so the group comes from v1."""

    class PushAfterFirst(FakeReplica):
        async def __call__(self, req: GenerateRequest) -> GenerateResponse:
            resp = await super().__call__(req)
            self.version = 1  # every request after the first one runs under v1
            return resp

    fake = PushAfterFirst()
    gen = _gen(fake, partial="off")
    g = asyncio.run(gen.group(Prompt(uid="u", prompt_ids=[1], answer="a"), seed=10))
    assert [s.versions for s in g.samples] == [[1] * 4, [1] * 4]
    assert gen.stats["async/off_regenerated"] == 1
    assert [r.seed for r in fake.calls] == [10, 11, 10]  # sample 0 again, with its seed
    assert all(s.reward == 4.0 for s in g.samples)  # the regenerated sample was scored
    keep = _gen(PushAfterFirst(), partial="keep")  # keep: tokens carry their versions, nothing regenerated
    g = asyncio.run(keep.group(Prompt(uid="u", prompt_ids=[1], answer="a"), seed=10))
    assert [s.versions[0] for s in g.samples] == [0, 1] and not keep.stats["async/off_regenerated"]


def test_off_fails_a_group_that_pushes_keep_overtaking_within_the_request_timeout():
    """A push between every two requests (the fake's version rises with each): the group never comes from one
    version, and fails naming the prompt and the setting once rollout.request_timeout_s has passed."""
    gen = _gen(FakeReplica(), partial="off", request_timeout_s=0.2)
    with pytest.raises(RuntimeError, match=r"prompt u: pushes kept landing .*rollout.request_timeout_s=0.2s"):
        asyncio.run(gen.group(Prompt(uid="u", prompt_ids=[1], answer="a"), seed=0))
    assert gen.stats["async/off_regenerated"] >= 1 and not gen.inflight


def test_generator_fails_a_failed_request_clearly():
    """Retrying on a live replica is the GenerateFn's (tests/test_faults.py); what still fails names the
    prompt and fails the group (its prompt goes back to the stream)."""

    class Flaky(FakeReplica):
        async def __call__(self, req: GenerateRequest) -> GenerateResponse:
            self.calls.append(req)
            raise ConnectionError("replica died")

    gen = _gen(Flaky())
    with pytest.raises(RuntimeError, match="rollout failed for prompt u: replica died"):
        asyncio.run(gen.group(Prompt(uid="u", prompt_ids=[1], answer="a"), seed=0, n=1))
    assert gen.stats["rollout/request_failures"] == 1


def test_generator_overlong_punishment_shapes_training_rewards_only():
    """reward.overlong_buffer=2, overlong_factor=0.5 with max_tokens 4: a 4-token response (the fake's
    length) loses 0.5 in training, scored at once or after the batch; validation rewards stay raw."""
    gen = _gen(FakeReplica(), RewardConfig(overlong_buffer=2, overlong_factor=0.5))
    g = asyncio.run(gen.group(Prompt(uid="u", prompt_ids=[1], answer="a"), seed=0))
    assert [s.reward for s in g.samples] == [3.5, 3.5]  # 4 words - 0.5
    assert all(s.reward_extras["overlong_penalty"] == -0.5 for s in g.samples)
    g = asyncio.run(gen.group(Prompt(uid="v", prompt_ids=[1], answer="a"), seed=0, score_now=False))
    g = asyncio.run(gen.score_group(g))
    assert [s.reward for s in g.samples] == [3.5, 3.5]
    val = asyncio.run(gen.group(Prompt(uid="w", prompt_ids=[1], answer="a"), seed=0, n=1, train=False))
    assert val.samples[0].reward == 4.0 and "overlong_penalty" not in val.samples[0].reward_extras


def test_generator_passes_top_k_and_stop_strings():
    """Training requests carry `rollout.top_k` and `rollout.stop`; a greedy one (validation) keeps the stop
    strings and drops top-k, as it drops top-p."""
    fake = FakeReplica()
    gen = _gen(fake, top_p=0.8, top_k=7, stop=["</a>"])
    asyncio.run(gen.group(Prompt(uid="u", prompt_ids=[1, 2], answer="x"), seed=3))
    asyncio.run(
        gen.group(Prompt(uid="v", prompt_ids=[1, 2], answer="x"), seed=0, n=1, temperature=0.0, train=False)
    )
    train, val = fake.calls[0], fake.calls[-1]
    assert (train.top_k, train.top_p, train.stop) == (7, 0.8, ["</a>"])
    assert (val.top_k, val.top_p, val.stop) == (0, 1.0, ["</a>"])


def test_trainer_behaviour_logprobs_ask_the_engine_for_none():
    """`rollout.behaviour_logprobs=trainer` reaches the requests from the run's config (vLLM then computes no
    log-probs); the default asks for the sampled tokens'."""
    for value, wanted in (("engine", True), ("trainer", False)):
        for group in (True, False):  # one request a group (the default), or one a sample
            fake = SeededReplica() if group else FakeReplica()
            cfg = load_config(
                None, [f"rollout.behaviour_logprobs={value}", f"rollout.group_requests={group}"]
            )
            c = typed(cfg)
            gen = GroupGenerator(
                fake, lambda ids: " ".join(map(str, ids)), _score, c.rollout, reward=c.reward, seed=c.seed
            )
            asyncio.run(gen.group(Prompt(uid="u", prompt_ids=[1, 2], answer="x"), seed=3))
            assert len(fake.calls) == (1 if group else cfg.rollout.n), (value, group)
            assert all(r.logprobs is wanted for r in fake.calls), (value, group)
