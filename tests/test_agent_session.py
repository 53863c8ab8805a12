"""Agent sessions without Ray or HTTP: trajectory assembly (prefix consistency, masks, log-probs,
versions), the chat core's prompt building and session records, and the runner's errors. A scripted model
plays the replicas (the true boundary: generation); a thin stand-in for the Serve handle calls the real
`ChatCore`; the agents call the core directly instead of over HTTP (that path is
tests/integration/test_openai_endpoint.py's, with the official client)."""

from __future__ import annotations

import asyncio
import math
from collections import Counter

import pytest

from app.agent.openai_chat import ChatCore, ChatSettings, RequestError, render_chat
from app.agent.session import AgentEpisode, Inconsistent, SessionCall, assemble, resolve_agent
from app.config import ConfigError, EnvConfig, RewardConfig, RolloutConfig
from app.envs.base import EpisodeMaker
from app.preflight import load_config
from app.records import Prompt
from app.rewards import RewardResult
from app.rollout import GroupGenerator
from tests.test_episodes import EOS, TOK, Model, dec, enc, tool_user

PROMPT = Prompt(uid="p0", prompt_ids=enc("12*34="), answer="408", prompt_text="12*34=")


def call(prompt: str, completion: str, version: int, eos: bool = True) -> SessionCall:
    ids = [*enc(completion), *([EOS] if eos else [])]
    return SessionCall(
        prompt_ids=enc(prompt) if "<eos>" not in prompt else TOK.encode(prompt, add_special_tokens=False),
        completion_ids=ids,
        logprobs=[-0.25 * (k + 1) for k in range(len(ids))],
        versions=[version] * len(ids),
        finish_reason="stop" if eos else "length",
    )


def test_assemble_masks_environment_tokens_and_keeps_model_logprobs_and_versions():
    c1 = call("12*34=", "[12*34]", version=3)
    c2 = call("12*34=[12*34]<eos>>408|", "408", version=4)
    traj = assemble(PROMPT.prompt_ids, [c1, c2])
    s = traj.sample("stop")
    obs = enc(">408|")
    assert s.token_ids == c1.completion_ids + obs + c2.completion_ids
    assert s.loss_mask == [1] * 8 + [0] * 5 + [1] * 4
    assert s.logprobs == c1.logprobs + [0.0] * 5 + c2.logprobs
    assert s.versions == [3] * 8 + [3] * 5 + [4] * 4  # environment tokens: the model token before them
    assert s.turns == 2 and s.model_tokens == 12
    # the first call's prompt may extend the row's (e.g. a system suffix): those tokens are masked
    c0 = call("12*34=?", "1", version=0)
    s = assemble(PROMPT.prompt_ids, [c0]).sample("stop")
    assert s.token_ids == [enc("?")[0], *c0.completion_ids] and s.loss_mask == [0, 1, 1]
    assert s.versions == [0, 0, 0]


def test_assemble_refuses_an_inconsistent_session_keeping_its_consistent_part():
    c1 = call("12*34=", "[12*34]", version=0)
    edited = call("12*34=[12*35]<eos>>420|", "420", version=0)  # the agent rewrote the model's reply
    with pytest.raises(
        Inconsistent, match="call 2's prompt does not extend call 1's.*differs at token 11"
    ) as e:
        assemble(PROMPT.prompt_ids, [c1, edited])
    assert e.value.traj.tokens == c1.completion_ids and e.value.traj.mask == [1] * 8
    with pytest.raises(Inconsistent, match="call 1's prompt does not extend the row's prompt"):
        assemble(PROMPT.prompt_ids, [call("99*34=", "1", 0)])


def _core(policy=tool_user) -> tuple[ChatCore, Model]:
    model = Model(policy)
    settings = ChatSettings(
        model_name="relay",
        max_model_len=64,
        max_tokens=12,
        temperature=1.0,
        top_p=1.0,
        request_timeout_s=120.0,
        session_ttl_s=3600.0,
    )
    return ChatCore(TOK, model, settings), model


SESSION = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 12, "seed": 5, "max_calls": 3}


async def calc_chat(core: ChatCore, sid: str, prompt: str, logprobs: bool = True) -> tuple[list[dict], float]:
    """An agent loop: ask, run the tool call the model wrote, send back its result, read the answer."""
    msgs = [{"role": "user", "content": prompt}]
    r1 = await core.complete(sid, {"model": "x", "messages": msgs, "logprobs": logprobs})
    call_text = r1["choices"][0]["message"]["content"]
    a, b = call_text.strip("[]").split("*")
    msgs += [{"role": "assistant", "content": call_text}, {"role": "user", "content": f">{int(a) * int(b)}|"}]
    r2 = await core.complete(sid, {"model": "x", "messages": msgs, "logprobs": logprobs})
    return [r1, r2], float(r2["choices"][0]["message"]["content"] == str(int(a) * int(b)))


def test_chat_core_records_a_session_that_assembles_into_the_calculator_trajectory():
    core, model = _core()
    core.open_session("s1", SESSION)
    (r1, r2), reward = asyncio.run(calc_chat(core, "s1", "12*34="))
    assert reward == 1.0 and r1["choices"][0]["message"]["content"] == "[12*34]"
    assert model.calls == ["12*34=", "12*34=[12*34]>408|"]  # the fallback template: the episode's layout
    assert r2["relay"]["token_ids"] == [*enc("408"), EOS] and r2["relay"]["versions"] == [0] * 4
    assert [c["logprob"] for c in r2["choices"][0]["logprobs"]["content"]] == r2["relay"]["logprobs"]
    assert r2["usage"] == {"prompt_tokens": 19, "completion_tokens": 4, "total_tokens": 23}
    calls = core.take_session("s1")
    assert core.take_session("s1") == [] and "s1" not in core.sessions
    assert calls[1].prompt_ids == calls[0].prompt_ids + calls[0].completion_ids + enc(">408|")
    s = assemble(PROMPT.prompt_ids, calls).sample("stop")
    assert dec(s.token_ids) == "[12*34]>408|408" and s.loss_mask == [1] * 8 + [0] * 5 + [1] * 4
    assert render_chat(TOK, [{"role": "system", "content": "1"}, {"role": "user", "content": "2"}]) == "1\n2"


def test_chat_core_keeps_a_session_consistent_when_a_reply_holds_a_special_token():
    """A reply's UNK is not in the content the client gets back (nor sends back): the next call's context
    still holds the tokens the model sampled, so the session assembles into one trajectory."""
    core, _ = _core(lambda text: tool_user(text) + ("\u00e9" if ">" not in text else ""))
    core.open_session("s1", SESSION)
    (r1, _), reward = asyncio.run(calc_chat(core, "s1", "12*34="))
    assert r1["relay"]["token_ids"] == [*enc("[12*34]"), TOK.unk_token_id, EOS] and reward == 1.0
    calls = core.take_session("s1")
    assert calls[1].prompt_ids == calls[0].prompt_ids + calls[0].completion_ids + enc(">408|")
    assert assemble(PROMPT.prompt_ids, calls).turns == 2


def test_chat_core_refuses_what_would_falsify_the_record():
    core, _ = _core()
    core.open_session("s", {**SESSION, "max_calls": 1})
    body = {"messages": [{"role": "user", "content": "12*34="}]}
    with pytest.raises(RequestError, match="temperature=0.2: this session samples.*temperature=1.0"):
        asyncio.run(core.complete("s", {**body, "temperature": 0.2}))
    for bad, what in (({"stream": True}, "streaming"), ({"n": 2}, "n must be 1"), ({"stop": ["|"]}, "stop")):
        with pytest.raises(RequestError, match=what):
            asyncio.run(core.complete("s", {**body, **bad}))
    with pytest.raises(RequestError, match="no open session 'nope'") as e:
        asyncio.run(core.complete("nope", body))
    assert e.value.status == 404
    asyncio.run(core.complete("s", {**body, "temperature": 1.0}))  # repeating the session's value is fine
    with pytest.raises(RequestError, match="env.max_turns=1 calls"):
        asyncio.run(core.complete("s", body))
    with pytest.raises(RequestError, match="no room left within rollout.max_model_len=64"):
        asyncio.run(core.complete(None, {"messages": [{"role": "user", "content": "1" * 64}]}))
    r = asyncio.run(core.complete(None, {**body, "temperature": 0.0}))  # no session: the request's settings
    assert r["relay"]["session"] is None and r["choices"][0]["logprobs"] is None


class FrontendHandle:
    """Stands in for the Serve handle of the frontend deployment (`.method.remote(...)` is awaitable)."""

    def __init__(self, core: ChatCore) -> None:
        self.core = core

    def __getattr__(self, name: str):
        fn = getattr(self.core, name)

        class _Method:
            @staticmethod
            async def remote(*a):
                return fn(*a)

        return _Method


class Episodes(EpisodeMaker):
    """The runner's factory, its frontend replaced by the handle stand-in."""

    def __init__(self, agent, core: ChatCore, timeout_s: float = 5.0) -> None:
        self.agent, self.core, self.timeout_s = agent, core, timeout_s

    def make_episode(self, turns, env, on_error):
        return AgentEpisode(
            turns, self.agent, FrontendHandle(self.core), "http://relay.test/relay", env, on_error
        )


async def _unused_score(*_a) -> RewardResult:
    raise AssertionError("an agent session's reward comes from the agent")


def _gen(episodes: Episodes, n: int = 2) -> GroupGenerator:
    return GroupGenerator(
        None,  # every model call goes through the chat core's own GenerateFn
        dec,
        _unused_score,
        RolloutConfig(n=n, max_tokens=12),
        reward=RewardConfig(on_error=-1.0),
        seed=0,
        stats=Counter(),
        env=episodes,
        encode=enc,
        limits=EnvConfig(
            max_turns=3, max_total_tokens=40, step_timeout_s=2.0, agent_timeout_s=episodes.timeout_s
        ),
    )


def sid_of(base_url: str) -> str:
    assert base_url.startswith("http://relay.test/relay/s/") and base_url.endswith("/v1")
    return base_url.split("/s/")[1][: -len("/v1")]


def test_runner_turns_each_sample_into_a_trajectory_with_the_agents_reward():
    core, _ = _core()
    seen = []

    async def agent(base_url: str, row: dict) -> dict:
        seen.append(row)
        reward = (await calc_chat(core, sid_of(base_url), row["prompt"]))[1]
        return {"score": reward, "tool_calls": 1, "correct": reward, "note": "not a number: dropped"}

    gen = _gen(Episodes(agent, core))
    g = asyncio.run(gen.group(PROMPT, seed=1))
    for s in g.samples:
        assert s.text == "[12*34]>408|408" and s.loss_mask == [1] * 8 + [0] * 5 + [1] * 4
        assert s.reward == 1.0 and s.reward_error is None and (s.turns, s.finish_reason) == (2, "stop")
        assert s.logprobs == [-0.5] * 8 + [0.0] * 5 + [-0.5] * 4
        assert s.tool_calls == 1 and s.reward_extras == {"correct": 1.0}
    assert seen[0] == {"uid": "p0", "prompt": "12*34=", "answer": "408", "data_source": ""}
    assert core.sessions == {} and gen.stats["env/steps"] == 2


def test_runner_scores_failed_sessions_on_error_and_counts_them():
    core, _ = _core()

    async def raising(base_url: str, row: dict) -> float:
        await core.complete(sid_of(base_url), {"messages": [{"role": "user", "content": row["prompt"]}]})
        raise ConnectionError("the agent's tool server is down")

    async def hanging(base_url: str, row: dict) -> float:
        await asyncio.Event().wait()
        return 1.0

    async def editing(base_url: str, row: dict) -> float:
        sid = sid_of(base_url)
        await core.complete(sid, {"messages": [{"role": "user", "content": row["prompt"]}]})
        msgs = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": "[1*1]"}]
        await core.complete(sid, {"messages": [*msgs, {"role": "user", "content": ">1|"}]})
        return 1.0

    async def nan(base_url: str, row: dict) -> float:
        return math.nan

    cases = (
        (raising, "exception", 8),
        (hanging, "timeout", 0),
        (editing, "inconsistent", 8),
        (nan, "invalid", 0),
    )
    for agent, kind, kept in cases:
        gen = _gen(Episodes(agent, core, timeout_s=0.3))
        for s in asyncio.run(gen.group(PROMPT, seed=1)).samples:
            assert s.reward == -1.0 and s.reward_error == f"env_{kind}", (kind, s.reward_error)
            assert len(s.token_ids) == kept and s.loss_mask == [1] * kept  # the consistent part is kept
        assert gen.stats[f"env/errors_{kind}"] == 2 and core.sessions == {}


def test_config_and_agent_resolution():
    cfg = load_config(None, ["env.name=openai_agent", "env.agent=tests.test_agent_session:example_agent"])
    assert cfg.env.agent_timeout_s == 120.0 and cfg.env.http_port == 0
    with pytest.raises(ConfigError, match="env.agent.*set env.agent=pkg.module:function"):
        load_config(None, ["env.name=openai_agent"])
    # a function that cannot be imported fails at load, before Ray and vLLM start, naming what is wrong
    with pytest.raises(ConfigError, match=r"'env.agent'.*nope:fn.*cannot import it \(ModuleNotFoundError"):
        load_config(None, ["env.name=openai_agent", "env.agent=nope:fn"])
    with pytest.raises(ConfigError, match=r"'env.agent'.*must accept \(base_url, row\)"):
        load_config(None, ["env.name=openai_agent", "env.agent=tests.test_agent_session:call"])
    assert resolve_agent("tests.test_agent_session:example_agent") is example_agent
    with pytest.raises(ValueError, match="cannot import it"):
        resolve_agent("tests.test_agent_session:nope")
    with pytest.raises(ValueError, match=r"must accept \(base_url, row\)"):
        resolve_agent("tests.test_agent_session:call")


async def example_agent(base_url: str, row: dict) -> float:
    return 0.0
