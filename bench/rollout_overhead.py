"""Generated tokens/s through Relay's Serve rollout path vs a raw vLLM AsyncLLM, same engine args and requests.

    python bench/rollout_overhead.py [--prompts 64] [--n 8] [--max-tokens 64] [--rounds 3]
    python bench/rollout_overhead.py --gpu --shape 0.5b --max-tokens 256     # a Qwen2.5-0.5B-shaped model

The embedded tiny model by default; `--shape 0.5b|1.5b|3b` builds a Qwen2.5-shaped model with random weights
and a synthetic word-level tokenizer over the full 151,936-token vocabulary (prompts are random token ids).

Runs the raw engine in this process and the same requests through one Serve replica (the deployment of
app/serve_rollout.py, weight-sync loop running). With `--interleave` (the default with `--gpu`) both engines
stay up, each with its own share of the GPU, and the rounds alternate (raw, Serve, raw, ...), so that drifts
of the machine hit both paths alike; otherwise the raw engine runs all its rounds and is shut down before the
replica starts. Prints a final JSON line with the best-round and median-round ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.config import load_config
from app.infra.resources import memory_share
from app.records import GenerateRequest
from app.vllm import engine as vla

log = logging.getLogger("bench.rollout_overhead")


def synthetic_model(shape: str, gpu: bool) -> str:
    """A Qwen2.5-shaped model directory: random bf16 weights and a tokenizer with the full vocabulary."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ipc_push import model_dir

    path = model_dir(shape)
    cfg = AutoConfig.from_pretrained(path)
    torch.manual_seed(0)
    with torch.device("cuda" if gpu else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    vocab = {f"<t{i}>": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<t0>"))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<t1>", pad_token="<t0>", unk_token="<t0>")
    fast.save_pretrained(path)
    if gpu:
        torch.cuda.empty_cache()
    return path


def random_prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(count)]


def requests(prompts: list[list[int]], n: int, max_tokens: int) -> list[dict]:
    return [
        {
            "prompt_ids": p,
            "n": n,
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "top_p": 1.0,
            "seed": i,
            "ignore_eos": True,
        }
        for i, p in enumerate(prompts)
    ]


async def rate_raw(engine, reqs: list[dict]) -> float:
    """One round of `reqs` on the raw AsyncLLM: generated tokens/s."""
    t0 = time.perf_counter()
    outs = await asyncio.gather(
        *[
            vla.generate(
                engine,
                q["prompt_ids"],
                n=q["n"],
                max_tokens=q["max_tokens"],
                temperature=1.0,
                top_p=1.0,
                version=0,
                seed=q["seed"],
                ignore_eos=True,
            )
            for q in reqs
        ]
    )
    return sum(len(s["token_ids"]) for o in outs for s in o) / (time.perf_counter() - t0)


async def rate_serve(handle, reqs: list[dict]) -> float:
    """One round of `reqs` through the Serve deployment: generated tokens/s."""
    t0 = time.perf_counter()
    outs = await asyncio.gather(*[handle.generate.remote(GenerateRequest(**q)) for q in reqs])
    return sum(len(s.token_ids) for o in outs for s in o.samples) / (time.perf_counter() - t0)


def start_serve(cfg, model_path: str, gpu: bool):
    """A local Ray cluster, the weight hub and one rollout replica (Relay's deployment): its handle."""
    import ray
    from ray import serve

    from app.names import NAMESPACE, app_name, hub_name
    from app.serve_rollout import build_app
    from app.weights.hub import WeightHub

    ray.init(
        address="local", num_cpus=16, num_gpus=1 if gpu else 0, include_dashboard=False, log_to_driver=False
    )
    hub = ray.remote(WeightHub).options(name=hub_name("bench"), namespace=NAMESPACE, num_cpus=0).remote()
    ray.get(hub.status.remote())
    return serve.run(build_app(cfg, model_path), name=app_name("bench"), route_prefix=None)


def stop_serve() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


async def measure(cfg, model_path: str, engine_kw: dict, reqs: list[dict], args) -> tuple[list, list]:
    """Tokens/s per round of each path (each path's first round warms up and is dropped).

    `--interleave` keeps both engines up (each with its own share of the GPU) and alternates the rounds,
    raw, Serve, raw, ...: drifts of the machine (clocks, other tenants) then hit both paths alike. Otherwise
    the raw engine runs all its rounds and is shut down before the Serve replica starts."""
    raw, served = [], []
    engine = vla.create_engine(model_path, **engine_kw)
    try:
        if not args.interleave:
            for r in range(args.rounds + 1):
                rate = await rate_raw(engine, reqs)
                raw += [rate] if r else []
            vla.shutdown(engine)
            engine = None
        handle = start_serve(cfg, model_path, args.gpu)
        try:
            for r in range(args.rounds + 1):
                if engine is not None:
                    rate = await rate_raw(engine, reqs)
                    raw += [rate] if r else []
                rate = await rate_serve(handle, reqs)
                served += [rate] if r else []
        finally:
            stop_serve()
    finally:
        if engine is not None:
            vla.shutdown(engine)
    return raw, served


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shape", default="", help="0.5b, 1.5b or 3b: a Qwen2.5-shaped model (random weights)")
    ap.add_argument("--set", nargs="*", default=[], help="config overrides (key=value) for both paths")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens with --shape")
    ap.add_argument("--gpu", action="store_true", help="vLLM on the GPU (configs/gpu1.yaml's replica share)")
    ap.add_argument(
        "--interleave",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="both engines up, rounds alternating (default: on with --gpu; each takes its own GPU share)",
    )
    args = ap.parse_args()
    if args.interleave is None:
        args.interleave = args.gpu
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    max_len = args.prompt_len + args.max_tokens if args.shape else 256
    overrides = ["ray.name=bench", f"rollout.max_model_len={max_len}", *args.set]
    cfg = load_config("gpu1" if args.gpu else None, overrides)
    if not args.gpu:
        os.environ.update(vla.cpu_env(cfg.rollout.kv_cache_gib))
    if args.shape:
        model_path = synthetic_model(args.shape, args.gpu)
        prompts = random_prompts(args.prompts, args.prompt_len, 151936)
    else:
        from transformers import AutoTokenizer

        from app.driver import resolve_inputs

        inputs = resolve_inputs(cfg)
        model_path = inputs.model_path
        tok = AutoTokenizer.from_pretrained(model_path)
        prompts = [tok.encode(r.prompt, add_special_tokens=False) for r in inputs.val_rows[: args.prompts]]
    reqs = requests(prompts, args.n, args.max_tokens)
    r = cfg.rollout
    engine_kw = dict(
        dtype=cfg.model.dtype,
        max_model_len=r.max_model_len,
        max_num_seqs=r.max_num_seqs,
        gpu_memory_utilization=memory_share(r),
        seed=cfg.seed,
        use_gpu=args.gpu,
        cuda_graphs=r.cuda_graphs,
    )
    raw, served = asyncio.run(measure(cfg, model_path, engine_kw, reqs, args))
    log.info("raw AsyncLLM: %s tokens/s", [round(x) for x in raw])
    log.info("Serve rollout: %s tokens/s", [round(x) for x in served])
    raw_best, serve_best = max(raw), max(served)
    med = statistics.median
    result = {
        "bench": "rollout_overhead",
        "model": args.shape or "tiny",
        "gpu": args.gpu,
        "prompts": args.prompts,
        "n": args.n,
        "max_tokens": args.max_tokens,
        "raw_tokens_per_s": round(raw_best, 1),
        "serve_tokens_per_s": round(serve_best, 1),
        "serve_over_raw": round(serve_best / raw_best, 3),
        "median_serve_over_raw": round(med(served) / med(raw), 3),
        "interleaved": args.interleave,
        "raw_rounds": [round(x) for x in raw],
        "serve_rounds": [round(x) for x in served],
        "overrides": args.set,
    }
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
