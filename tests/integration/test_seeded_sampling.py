"""Per-request seeds on vLLM's CPU engine (app/vllm/seeded_cpu.py), on a real engine with the worker extension.

Prompts longer than `max_num_batched_tokens` are prefilled in chunks, so the runner throws away the token it
sampled after each chunk and undoes that draw (`set_offset`), which killed a stock CPU engine core ("CPU
Generator does not use offset"). The same seeds must then give the same tokens whether the requests run
together, one at a time, or in the reverse order. The engine runs in a child process (the CPU engine's
environment is set before vLLM is imported), stopped by its pid.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid

from tests.integration.conftest import REPO

PROMPTS = [[3 + (i * 7 + j) % 15 for j in range(40)] for i in range(4)]  # 40 tokens: 3 chunks of 16
SEEDS = [11, 12, 13, 14]


async def _sample(engine, prompts, seeds, together: bool) -> list[list[int]]:
    from vllm import SamplingParams

    async def one(prompt: list[int], seed: int) -> list[int]:
        params = SamplingParams(n=1, max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True)
        final = None
        async for out in engine.generate({"prompt_token_ids": prompt}, params, uuid.uuid4().hex):
            final = out
        return list(final.outputs[0].token_ids)

    if together:
        return list(await asyncio.gather(*[one(p, s) for p, s in zip(prompts, seeds, strict=True)]))
    return [await one(p, s) for p, s in zip(prompts, seeds, strict=True)]


async def _check(model: str) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from app.vllm.engine import WORKER_EXTENSION

    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=model,
            dtype="float32",
            max_model_len=128,
            max_num_seqs=4,
            enforce_eager=True,
            seed=0,
            worker_extension_cls=WORKER_EXTENSION,
            enable_prefix_caching=False,
            distributed_executor_backend="uni",
            max_num_batched_tokens=16,
            enable_chunked_prefill=True,
        )
    )
    try:
        together = await _sample(engine, PROMPTS, SEEDS, True)
        alone = await _sample(engine, PROMPTS, SEEDS, False)
        reverse = (await _sample(engine, PROMPTS[::-1], SEEDS[::-1], True))[::-1]
        logprobs = await _logprob_paths(engine)
    finally:
        engine.shutdown()
    return {"together": together, "alone": alone, "reverse": reverse, **logprobs}


async def _logprob_paths(engine) -> dict:
    """One seeded request three ways: vLLM's own (plain SamplingParams), Relay's `generate`, and `generate`
    without log-probs (`rollout.behaviour_logprobs=trainer`)."""
    from vllm import SamplingParams

    from app.vllm import engine as vla

    params = SamplingParams(n=1, max_tokens=12, temperature=1.0, seed=5, ignore_eos=True, logprobs=0)
    final = None
    async for out in engine.generate({"prompt_token_ids": PROMPTS[0]}, params, uuid.uuid4().hex):
        final = out
    comp = final.outputs[0]
    dicts = [comp.logprobs[i][t].logprob for i, t in enumerate(comp.token_ids)]
    kw = dict(n=1, max_tokens=12, temperature=1.0, top_p=1.0, version=0, seed=5, ignore_eos=True)
    relay = (await vla.generate(engine, PROMPTS[0], **kw))[0]
    none = (await vla.generate(engine, PROMPTS[0], logprobs=False, **kw))[0]
    return {
        "dict_ids": list(comp.token_ids),
        "dict_lps": dicts,
        "relay": relay,
        "none": none,
    }


def test_seeded_requests_survive_chunked_prefill_and_do_not_depend_on_batching(cache_dir):
    from app.config import load_config
    from app.driver import resolve_inputs
    from app.vllm.engine import cpu_env

    model = resolve_inputs(load_config(None, [f"model.cache_dir={cache_dir}"])).model_path
    out = cache_dir / "seeded.json"
    env = {**os.environ, **cpu_env(1), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.test_seeded_sampling", model, str(out)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=30)
    assert proc.returncode == 0, log[-4000:]
    got = json.loads(out.read_text())
    assert all(len(t) == 24 for t in got["together"]), got
    assert got["together"] == got["alone"] == got["reverse"], got
    # Relay's log-probs are vLLM's own, token for token; without them the tokens do not change
    relay, none = got["relay"], got["none"]
    assert relay["token_ids"] == none["token_ids"] == got["dict_ids"], got
    assert relay["logprobs"] == got["dict_lps"] and all(lp < 0 for lp in relay["logprobs"]), got
    assert none["logprobs"] == [0.0] * 12, none


if __name__ == "__main__":
    result = asyncio.run(_check(sys.argv[1]))
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
