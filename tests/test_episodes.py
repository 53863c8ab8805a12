"""Multi-turn episodes without Ray: the calculator environment, trajectories (masks, versions, log-probs),
limits, failing environments, a freeze mid-episode and its resume; a fake replica plays the model (the
true boundary: generation), the tokenizer is the built-in calculator task's."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from app.config import EnvConfig, RewardConfig, RolloutConfig
from app.envs import ENVIRONMENTS, make_factory
from app.envs.base import EnvStep
from app.envs.calculator import CalculatorEnv
from app.records import GenerateRequest, GenerateResponse, Prompt, Sample
from app.rewards import RewardResult
from app.rollout import Frozen, GroupGenerator
from app.rollout.episode import env_metrics
from app.tasks.calc import CALC_CHARS, head_answer, make_calc_problems, warmup_example
from app.tasks.tiny import build_tokenizer

TOK = build_tokenizer(CALC_CHARS, 64)
EOS = TOK.eos_token_id


def enc(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def dec(ids: list[int]) -> str:
    return TOK.decode(ids, skip_special_tokens=True)


class Model:
    """Plays the model: `policy(context text) -> reply`; each token's log-prob is -0.5 and its version the
    fake's current `version`; `abort_next` makes the next reply stop after its first token (a push)."""

    def __init__(self, policy) -> None:
        self.policy, self.version, self.calls, self.abort_next = policy, 0, [], False

    async def __call__(self, req: GenerateRequest) -> GenerateResponse:
        text = dec(req.prompt_ids)
        self.calls.append(text)
        ids = [*enc(self.policy(text)), EOS][: req.max_tokens]
        finish = "stop" if ids[-1] == EOS else "length"
        if self.abort_next:
            self.abort_next, ids, finish = False, ids[:1], "abort"
        s = Sample(
            token_ids=ids,
            logprobs=[-0.5] * len(ids),
            versions=[self.version] * len(ids),
            finish_reason=finish,
        )
        return GenerateResponse(samples=[s], replica="r0", version=self.version)


def tool_user(text: str) -> str:
    """Calls the calculator, then copies its answer."""
    if ">" in text:
        return text.rsplit(">", 1)[1].rstrip("|")
    return "[" + text.rstrip("=") + "]"


async def _unused_score(*_a) -> RewardResult:
    raise AssertionError("an episode's reward comes from its environment")


def _gen(model, factory=CalculatorEnv, limits: EnvConfig | None = None, **kw) -> GroupGenerator:
    """Episodes bounded by `limits` (the `env` section), a failed one scoring -1; `kw`: `rollout.*`."""
    return GroupGenerator(
        model,
        dec,
        _unused_score,
        RolloutConfig(n=2, max_tokens=8, **kw),
        reward=RewardConfig(on_error=-1.0),
        seed=0,
        stats=Counter(),
        env=factory,
        encode=enc,
        limits=limits or EnvConfig(max_turns=3, max_total_tokens=40, step_timeout_s=2.0),
    )


PROMPT = Prompt(uid="p0", prompt_ids=enc("12*34="), answer="408")


def test_calculator_environment():
    env = CalculatorEnv()
    assert asyncio.run(env.reset(PROMPT)) == ""
    assert asyncio.run(env.step("[12*34]")) == EnvStep(observation=">408|", tool_call=True)
    assert asyncio.run(env.step("[12*]")).observation == ">?|"
    assert asyncio.run(env.step("408")) == EnvStep(done=True, reward=1.0, extras={"correct": 1.0})
    assert asyncio.run(env.step("407")).reward == 0.0
    assert "calculator" in ENVIRONMENTS and make_factory("", None) is None
    with pytest.raises(ValueError, match="env.name='nope'.*calculator"):
        make_factory("nope", None)


def test_tool_episode_interleaves_masked_environment_tokens():
    model = Model(tool_user)
    gen = _gen(model)
    g = asyncio.run(gen.group(PROMPT, seed=1))
    s = g.samples[0]
    call, obs, answer = [*enc("[12*34]"), EOS], enc(">408|"), [*enc("408"), EOS]
    assert s.token_ids == call + obs + answer
    assert s.loss_mask == [1] * len(call) + [0] * len(obs) + [1] * len(answer)
    assert s.logprobs == [-0.5] * len(call) + [0.0] * len(obs) + [-0.5] * len(answer)
    assert s.reward == 1.0 and s.reward_error is None and s.reward_extras == {"correct": 1.0}
    assert (s.turns, s.tool_calls, s.finish_reason, s.model_tokens) == (2, 1, "stop", len(call) + len(answer))
    assert s.text == "[12*34]>408|408"
    assert sorted(model.calls) == ["12*34=", "12*34="] + ["12*34=[12*34]>408|"] * 2  # turn 2 sees the result
    m = env_metrics(g.samples)
    assert m["env/turns_mean"] == 2 and m["env/tool_calls"] == 1 and m["env/tool_call_rate"] == 1
    assert m["env/token_share"] == pytest.approx(len(obs) / len(s.token_ids))
    assert gen.stats["env/steps"] == 2 * 2 + 2  # two samples: a reset and two steps each


def test_direct_answer_and_limits():
    s = asyncio.run(_gen(Model(lambda t: "999")).group(PROMPT, seed=1)).samples[0]
    assert (s.reward, s.turns, s.tool_calls, s.loss_mask) == (0.0, 1, 0, [1] * 4)
    # always calling: cut at max_turns, the last observation kept, reward of the last step (0)
    s = asyncio.run(_gen(Model(lambda t: "[1+1]")).group(PROMPT, seed=1)).samples[0]
    assert (s.turns, s.tool_calls, s.finish_reason, s.reward) == (3, 3, "length", 0.0)
    assert dec(s.token_ids) == "[1+1]>2|" * 3
    # the total token budget cuts the trajectory (an observation is cut to what is left)
    lim = EnvConfig(max_turns=9, max_total_tokens=8, step_timeout_s=2.0)
    s = asyncio.run(_gen(Model(lambda t: "[1+1]"), limits=lim).group(PROMPT, seed=1)).samples[0]
    assert (
        s.text == "[1+1]>2"
        and s.loss_mask == [1] * 6 + [0, 0]
        and (s.turns, s.finish_reason) == (1, "length")
    )
    # a turn is also capped by what the budget leaves: 6 + 3 tokens, then a turn of one token
    lim = EnvConfig(max_turns=9, max_total_tokens=10, step_timeout_s=2.0)
    s = asyncio.run(_gen(Model(lambda t: "[1+1]"), limits=lim).group(PROMPT, seed=1)).samples[0]
    assert s.text == "[1+1]>2|[" and s.loss_mask == [1] * 6 + [0] * 3 + [1] and s.turns == 2


class Raising(CalculatorEnv):
    async def step(self, turn: str) -> EnvStep:
        raise KeyError("the tool's backend is down")


class Hanging(CalculatorEnv):
    async def step(self, turn: str) -> EnvStep:
        await asyncio.Event().wait()  # never set
        raise AssertionError


def test_failing_environments_score_on_error_and_are_counted():
    for factory, kind in ((Raising, "exception"), (Hanging, "timeout")):
        lim = EnvConfig(max_turns=3, max_total_tokens=40, step_timeout_s=0.2)
        gen = _gen(Model(tool_user), factory, lim)
        g = asyncio.run(gen.group(PROMPT, seed=1))
        for s in g.samples:
            assert s.reward == -1.0 and s.reward_error == f"env_{kind}" and s.turns == 1
            assert s.loss_mask == [1] * len(s.token_ids)  # the model's turn is kept
        assert gen.stats[f"env/errors_{kind}"] == 2 and not any(
            k.startswith("reward/errors") for k in gen.stats
        )


def test_versions_across_a_push_mid_episode():
    model = Model(tool_user)

    def bump(text: str) -> str:
        model.version = 1 if ">" in text else 0  # weights pushed between the two turns
        return tool_user(text)

    model.policy = bump
    s = asyncio.run(_gen(model).group(PROMPT, seed=1)).samples[0]
    n_call, n_obs = 8, 5
    assert s.versions == [0] * n_call + [0] * n_obs + [1] * 4  # observation tokens: the turn before theirs
    assert min(s.versions) == 0 and max(s.versions) == 1


class Counting(CalculatorEnv):
    steps: list[str] = []

    async def step(self, turn: str) -> EnvStep:
        Counting.steps.append(turn)
        return await super().step(turn)


def test_freeze_mid_episode_and_resume_replays_the_environment():
    model = Model(tool_user)
    gen = _gen(model, Counting, partial="keep")
    gen.freezing = True
    Counting.steps = []
    orig = model.__call__

    async def abort_second_turn(req: GenerateRequest) -> GenerateResponse:
        model.abort_next = ">" in dec(req.prompt_ids)
        return await orig(req)

    gen.generate = abort_second_turn
    with pytest.raises(Frozen) as e:
        asyncio.run(gen.group(PROMPT, seed=1))
    partial = e.value.samples
    head = [*enc("[12*34]"), EOS, *enc(">408|")]
    for s in partial:
        assert s.finish_reason == "abort" and s.token_ids == [*head, enc("4")[0]]
        assert s.loss_mask == [1] * 8 + [0] * 5 + [1] and s.turns == 1
    assert Counting.steps == ["[12*34]", "[12*34]"]
    # a restored run: the environment replays the finished turn, the cut turn continues from its token
    Counting.steps = []
    gen2 = _gen(Model(lambda t: "08"), Counting)
    g = asyncio.run(
        gen2.group(Prompt(uid="p0", prompt_ids=PROMPT.prompt_ids, answer="408", partial=partial), seed=1)
    )
    for s in g.samples:
        assert s.token_ids == [*head, *enc("408"), EOS] and s.reward == 1.0 and s.turns == 2
        assert s.loss_mask == [1] * 8 + [0] * 5 + [1] * 4
    assert sorted(Counting.steps) == ["408", "408", "[12*34]", "[12*34]"]
    back = Sample.from_dict(g.samples[0].to_dict())
    assert back.loss_mask == g.samples[0].loss_mask and back.turns == 2


def test_calc_task_rows_and_warmup_examples():
    train, val = make_calc_problems(0, n_val=16)
    assert len(val) == 16 and len(train) == 90 * 90 - 16
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    a, b = map(int, val[0]["prompt"].rstrip("=").split("*"))
    assert val[0]["answer"] == str(a * b)
    rng = random.Random(0)
    ids, mask = warmup_example(TOK, {"prompt": "12*34=", "answer": "408"}, rng, copy_only=True)
    assert dec(ids) == "12*34=[12*34]>408|408" and mask == [0] * 6 + [0] * 8 + [0] * 5 + [1] * 4
    seen = set()
    for _ in range(40):
        ids, mask = warmup_example(TOK, {"prompt": "12*34=", "answer": "408"}, rng)
        assert len(ids) == len(mask) and sum(mask) > 0 and mask[:6] == [0] * 6
        seen.add(dec(ids))
    # a tool call with the copied result, or the head answer (first factor times ten, wrong here)
    assert seen == {"12*34=[12*34]>408|408", "12*34=120"}
    assert head_answer("37*48=") == "370" and head_answer("37*10=") == str(37 * 10)
