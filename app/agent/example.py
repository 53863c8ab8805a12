"""An example agent for `env.name=openai_agent`: the calculator task (`builtin:calc`) driven through an
unmodified OpenAI client (`--config calc_agent`).

The agent asks the row's question, and while the model's reply is a tool call (`[37*48]`) it runs the
calculator itself and sends the result back as the next user message (`>1776|`), up to three calls; the
reward is 1 when the final answer is the row's (returned with the count of tool calls). Relay records the
session and trains on it as it trains the built-in calculator environment's episodes (the same token layout: the chat endpoint's fallback
template is Relay's episode layout), which makes this a check of the endpoint end to end.

The agent appends the model's replies exactly as the endpoint returned them: a session must stay
prefix-consistent (app/agent/session.py).
"""

from __future__ import annotations

from typing import Any

from app.envs.calculator import CalculatorEnv
from app.records import Prompt

MAX_CALLS = 3


async def calc_agent(base_url: str, row: dict[str, Any]) -> dict[str, float]:
    """Chat with the policy at `base_url` about `row` (its `prompt` and `answer`); returns the reward and
    the number of tool calls (counted as env/tool_calls)."""
    import openai

    env = CalculatorEnv()  # the tool; its rules also say when the episode is over and what it scored
    await env.reset(Prompt(uid=row["uid"], prompt_ids=[], answer=row["answer"]))
    messages = [{"role": "user", "content": row["prompt"]}]
    async with openai.AsyncOpenAI(base_url=base_url, api_key="relay", max_retries=0, timeout=60) as client:
        calls = 0
        for _ in range(MAX_CALLS):
            r = await client.chat.completions.create(model="relay", messages=messages)
            reply = r.choices[0].message.content or ""
            step = await env.step(reply)
            calls += int(step.tool_call)
            if step.done:
                return {"score": float(step.reward), "tool_calls": calls, **step.extras}
            messages += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": step.observation},
            ]
    return {"score": 0.0, "tool_calls": calls}
