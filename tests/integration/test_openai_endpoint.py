"""The OpenAI-compatible endpoint on the shared cluster: the official `openai` client chats through Serve's
HTTP proxy with the real vLLM CPU replica, and the recorded sessions become trajectories (masks, the
log-probs the responses reported, versions); then Relay's runner (`env.name=openai_agent`) runs an agent
function per sample, as the rollouter does."""

from __future__ import annotations

import asyncio
import itertools

import openai

from app.agent.openai_api import ROUTE_PREFIX
from app.rollout.episode import mask_runs

SECOND = "max:1290="  # the agent's follow-up question (the tiny arithmetic model's alphabet)


async def chat_agent(base_url: str, row: dict) -> float:
    """Two questions in one conversation through an unmodified OpenAI client; reward: the second is right."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key="relay", max_retries=0, timeout=60) as client:
        msgs = [{"role": "user", "content": row["prompt"]}]
        r1 = await client.chat.completions.create(model="relay", messages=msgs)
        msgs += [
            {"role": "assistant", "content": r1.choices[0].message.content},
            {"role": "user", "content": SECOND},
        ]
        r2 = await client.chat.completions.create(model="relay", messages=msgs, logprobs=True)
    return float(r2.choices[0].message.content == "9")


def test_openai_client_sessions_become_trajectories(rollout_stack):
    from omegaconf import OmegaConf
    from ray import serve
    from transformers import AutoTokenizer

    from app.agent.openai_api import build_frontend
    from app.names import FRONTEND_DEPLOYMENT, frontend_app_name
    from app.rollout.prompt_files import render_prompt

    agent = "tests.integration.test_openai_endpoint:chat_agent"
    cfg = OmegaConf.merge(rollout_stack["cfg"], {"env": {"name": "openai_agent", "agent": agent}})
    model_path = rollout_stack["inputs"].model_path
    name = frontend_app_name("it")
    serve.run(build_frontend(cfg, model_path), name=name, route_prefix=ROUTE_PREFIX)
    try:
        tok = AutoTokenizer.from_pretrained(model_path)
        row = rollout_stack["inputs"].val_rows[0]
        prompt_ids = render_prompt(row, tok)
        handle = serve.get_deployment_handle(FRONTEND_DEPLOYMENT, app_name=name)
        _client_session(rollout_stack["http_port"], handle, row.prompt, prompt_ids, tok)
        _runner_group(cfg, rollout_stack, row, prompt_ids, tok)
    finally:
        serve.delete(name)


def _client_session(port: int, handle, prompt: str, prompt_ids: list[int], tok) -> None:
    from app.agent.session import assemble

    settings = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 8, "seed": 3, "max_calls": 4}
    handle.open_session.remote("t1", settings).result(timeout_s=60)
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}{ROUTE_PREFIX}/s/t1/v1", api_key="relay", max_retries=0, timeout=60
    )
    assert [m.id for m in client.models.list().data] == ["builtin:tiny"]
    msgs = [{"role": "user", "content": prompt}]
    responses = []
    for follow_up in (SECOND, "max:5=", None):
        r = client.chat.completions.create(model="relay", messages=msgs, logprobs=True)
        responses.append(r)
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens > 0
        if follow_up:
            msgs += [{"role": "assistant", "content": r.choices[0].message.content}]
            msgs += [{"role": "user", "content": follow_up}]
    calls = handle.take_session.remote("t1").result(timeout_s=60)
    assert len(calls) == 3
    s = assemble(prompt_ids, calls).sample("stop")
    reported = [[c.logprob for c in r.choices[0].logprobs.content] for r in responses]
    relay = [r.model_extra["relay"] for r in responses]
    model_lps = [lp for lp, m in zip(s.logprobs, s.loss_mask, strict=True) if m]
    assert model_lps == [lp for lps in reported for lp in lps]  # what the responses reported, exactly
    assert all(lp <= 0 for lp in model_lps)
    runs = mask_runs(s.loss_mask)
    assert len(runs) == 3
    for (a, b), rel, r in zip(runs, relay, responses, strict=True):
        assert s.token_ids[a:b] == rel["token_ids"] and s.versions[a:b] == rel["versions"]
        assert tok.decode(rel["token_ids"], skip_special_tokens=True) == r.choices[0].message.content
    gaps = [s.token_ids[b:a2] for (_, b), (a2, _) in itertools.pairwise(runs)]
    follow = [tok.encode(t, add_special_tokens=False) for t in (SECOND, "max:5=")]
    for gap, ids, rel in zip(gaps, follow, relay, strict=False):  # environment tokens: the user's turns
        eos = [] if rel["token_ids"][-1] == tok.eos_token_id else [tok.eos_token_id]
        assert gap == eos + ids
    assert all(v == s.versions[0] for v in s.versions) and s.versions[0] >= -1


def _runner_group(cfg, rollout_stack, row, prompt_ids: list[int], tok) -> None:
    from collections import Counter

    from app.config import typed
    from app.envs import make_factory
    from app.records import Prompt
    from app.rollout import GroupGenerator
    from app.rollout.serve_generate import ServeGenerate

    async def unused(*_a):
        raise AssertionError("the agent gives the reward")

    stats: Counter[str] = Counter()
    c = typed(cfg)
    gen = GroupGenerator(
        ServeGenerate(rollout_stack["handle"], 60.0),
        lambda ids: tok.decode(ids, skip_special_tokens=True),
        unused,
        c.rollout,
        reward=c.reward,
        seed=c.seed,
        stats=stats,
        env=make_factory("openai_agent", cfg),
        encode=lambda t: tok.encode(t, add_special_tokens=False),
        limits=c.env,
    )
    prompt = Prompt(uid=row.uid, prompt_ids=prompt_ids, answer=row.answer, prompt_text=row.prompt)
    g = asyncio.run(asyncio.wait_for(gen.group(prompt, seed=1, n=2), 120))
    for s in g.samples:
        assert s.reward_error is None and s.reward in (0.0, 1.0) and s.turns == 2
        first, second = mask_runs(s.loss_mask)
        assert first[0] == 0 and s.token_ids[
            second[0] - len(tok.encode(SECOND, add_special_tokens=False)) : second[0]
        ] == tok.encode(SECOND, add_special_tokens=False)
        assert len(s.logprobs) == len(s.versions) == len(s.token_ids) and s.env_s >= 0
    assert not any(k.startswith("env/errors") for k in stats)
