"""The vLLM engine's time per decode step, by batch size and sampling option: what bounds generation.

    python bench/engine_step_cost.py                                           # the embedded model, CPU
    python bench/engine_step_cost.py --gpu --shape 1.5B --max-num-seqs 512 \\
        --points 512x256,256x256,128x512,32x1024,8x1024,1x1024    # docs/benchmarks.md's H100 figures

The engine is Relay's (`app.vllm.engine.create_engine`: the worker extension, log-probs after temperature,
CUDA graphs with `--gpu`), driven directly, without Serve (bench/rollout_overhead.py measures what Serve
adds). Each point `KxL` sends K requests at once, each of exactly L tokens (EOS ignored), so all K decode
together for L steps and seconds / L is one decode step at batch K. The variants repeat the first point with
other sampling options:

    ours    Relay's requests: a seed each, the sampled token's log-prob (`rollout` always asks for both)
    flat    ours, the log-probs returned in vLLM's flat lists (`flat_logprobs`) instead of a dict a token
    noseed  the log-prob, no seed
    nolp    neither
    greedy  temperature 0, neither

Prints a final JSON line: ms per step at each point, the ms each further sequence adds to a step (a
least-squares line through the points of batch >= 32), and each variant's time over `nolp`'s.

`--engines N` starts N engines on the one GPU instead (each its own process and engine core, a 1/N share of
the memory, started one after another by the engine's per-GPU start lock) and runs every point on all of them at once: whether the GPU has room
for more than one engine's decode steps, i.e. whether one engine's step is bound by its own CPU work.

    python bench/engine_step_cost.py --gpu --shape 1.5B --max-num-seqs 256 --engines 2 --points 256x256

`--pareto GROUPSxN:ALPHA:MIN:MAX` runs the variants on a long-tailed batch instead of the first point: the loop
bench's shape (`128x8:1.2:64:1024`: 128 groups of 8 sharing a Pareto length to 1,024 tokens), whose last
sequences decode alone; with `--engines`, every N-th request goes to each engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import os
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.config import load_config
from app.infra.resources import memory_share
from app.vllm import engine as vla

log = logging.getLogger("bench.engine_step_cost")

VARIANTS = {  # name: (seeded, logprobs, temperature, flat log-probs)
    "ours": (True, 0, 1.0, False),
    "flat": (True, 0, 1.0, True),
    "noseed": (False, 0, 1.0, False),
    "nolp": (False, None, 1.0, False),
    "greedy": (False, None, 0.0, False),
}


def pareto_lengths(spec: str, seed: int = 0) -> list[int]:
    """`128x8:1.2:64:1024` -> 1,024 response lengths: 128 groups of 8 samples sharing one length each,
    min(MAX, int(MIN x Pareto(ALPHA))), seeded (the draw of docs/benchmarks.md's loop-shaped batch)."""
    import random

    try:
        shape, alpha, low, high = spec.split(":")
        groups, _, n = shape.partition("x")
        g, k, a, lo, hi = int(groups), int(n), float(alpha), int(low), int(high)
    except ValueError:
        raise ValueError(f"--pareto {spec!r}: use GROUPSxN:ALPHA:MIN:MAX, e.g. 128x8:1.2:64:1024") from None
    rng = random.Random(seed)
    return [x for _ in range(g) for x in [min(hi, int(lo * (1 - rng.random()) ** (-1 / a)))] * k]


def parse_points(spec: str) -> list[tuple[int, int]]:
    """`512x256,32x1024` -> [(512, 256), (32, 1024)]: (requests at once, tokens each)."""
    out = []
    for part in spec.split(","):
        k, _, length = part.strip().partition("x")
        if not (k.isdigit() and length.isdigit() and int(k) > 0 and int(length) > 0):
            raise ValueError(f"point {part!r}: use KxL, K requests of L tokens each (e.g. 512x256)")
        out.append((int(k), int(length)))
    return out


def per_seq_ms(points: list[tuple[int, float]], min_batch: int = 32) -> float | None:
    """The slope, in ms per sequence, of a least-squares line through (batch, ms per step) for the points of
    batch >= `min_batch` (None with fewer than two such batches): what each further sequence adds to a step
    once the step no longer costs the same at any batch."""
    pts = [(float(k), ms) for k, ms in points if k >= min_batch]
    if len({k for k, _ in pts}) < 2:
        return None
    mk = sum(k for k, _ in pts) / len(pts)
    mm = sum(m for _, m in pts) / len(pts)
    return sum((k - mk) * (m - mm) for k, m in pts) / sum((k - mk) ** 2 for k, _ in pts)


async def timed_batch(
    engine, prompts: list[list[int]], k: int, length: int | list[int], variant: str
) -> float:
    """Seconds for `k` requests of exactly `length` tokens each (request i: `length[i]` where a list), all sent
    at once."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    seeded, logprobs, temperature, flat = VARIANTS[variant]

    async def one(i: int) -> None:
        params = SamplingParams(
            n=1,
            max_tokens=length[i] if isinstance(length, list) else length,
            temperature=temperature,
            top_p=1.0,
            logprobs=logprobs,
            seed=1000 + i if seeded else None,
            ignore_eos=True,
            detokenize=False,
            flat_logprobs=flat,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        prompt = {"prompt_token_ids": prompts[i % len(prompts)]}
        async for _ in engine.generate(prompt, params, uuid.uuid4().hex):
            pass

    t0 = time.perf_counter()
    await asyncio.gather(*[one(i) for i in range(k)])
    return time.perf_counter() - t0


async def measure(engine_kw: dict, prompts, points, variants, pareto: list[int] | None = None) -> dict:
    """Each point with Relay's requests, then each variant at the first point (on the `pareto` batch where
    given), on one engine."""
    engine = vla.create_engine(**engine_kw)  # inside the loop: the engine's output handler runs on it
    try:
        return await _measure(engine, prompts, points, variants, pareto)
    finally:
        vla.shutdown(engine)
        del engine  # while the interpreter is whole: AsyncLLM.__del__ shuts down again


async def _measure(engine, prompts, points, variants, pareto: list[int] | None = None) -> dict:
    await timed_batch(engine, prompts, min(64, points[0][0]), 8, "ours")  # warm-up: kernels, first graphs
    steps, per_step = {}, []
    for k, length in points:
        s = await timed_batch(engine, prompts, k, length, "ours")
        per_step.append((k, round(1e3 * s / length, 2)))
        steps[f"{k}x{length}"] = {"s": round(s, 3), "ms_per_step": per_step[-1][1]}
        log.info("%dx%d: %.2f s, %.2f ms a step", k, length, s, 1e3 * s / length)
    k, length = points[0]
    batch = (len(pareto), pareto) if pareto else (k, length)
    times = {v: await timed_batch(engine, prompts, *batch, v) for v in variants}
    for v, s in times.items():
        log.info("%s at %s: %.2f s", v, "the Pareto batch" if pareto else f"{k}x{length}", s)
    slope = per_seq_ms(per_step)
    return {
        "points": steps,
        "ms_per_extra_seq": None if slope is None else round(slope, 4),
        "variants_s": {v: round(s, 3) for v, s in times.items()},
        "over_nolp": {v: round(s / times["nolp"], 3) for v, s in times.items()} if "nolp" in times else {},
        **({"pareto_tokens": sum(pareto)} if pareto else {}),
    }


def _engine_process(i: int, engine_kw: dict, prompts, jobs, ready, barrier, results) -> None:
    """One of `--engines`: start (on a GPU one after another: `create_engine`'s per-GPU start lock), say
    `ready`, then run each job (k, length or lengths, variant) at the same moment as the others (`barrier`)
    and put (i, [seconds per job]) on `results`."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s engine{i} %(name)s %(message)s")

    async def run() -> list[float]:
        engine = vla.create_engine(**engine_kw)
        try:
            await timed_batch(engine, prompts, 64, 8, "ours")
            ready.set()
            out = []
            for k, length, variant in jobs:
                barrier.wait(timeout=900)
                out.append(await timed_batch(engine, prompts, k, length, variant))
            return out
        finally:
            vla.shutdown(engine)
            del engine

    results.put((i, asyncio.run(run())))


def measure_shared(
    engine_kw: dict, prompts, points, n: int, variants=(), pareto: list[int] | None = None, deadline_s=1800.0
) -> dict:
    """`n` engines on one GPU, started in turn, each running every point at once with the others, then (with
    `pareto`) every N-th request of the Pareto batch in each variant: tokens/s of them all against one
    engine's (the caller's single-engine run)."""
    jobs = [[(k, length, "ours") for k, length in points] for _ in range(n)]
    if pareto:
        for i in range(n):
            jobs[i] += [(len(pareto[i::n]), pareto[i::n], v) for v in variants]
    ctx = mp.get_context("spawn")
    kw = {**engine_kw, "gpu_memory_utilization": engine_kw["gpu_memory_utilization"] / n}
    readies = [ctx.Event() for _ in range(n)]
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [
        ctx.Process(target=_engine_process, args=(i, kw, prompts, jobs[i], readies[i], barrier, results))
        for i in range(n)
    ]
    for p in procs:
        p.start()
    try:
        for i in range(n):
            if not readies[i].wait(timeout=deadline_s):
                raise TimeoutError(f"engine {i} of {n} did not start within {deadline_s:.0f} s")
        got = dict(results.get(timeout=deadline_s) for _ in range(n))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    out = {}
    for j, (k, length) in enumerate(points):
        slowest = max(got[i][j] for i in range(n))
        out[f"{k}x{length}"] = {
            "s_each": [round(got[i][j], 3) for i in range(n)],
            "tokens_per_s": round(n * k * length / slowest, 1),
            "ms_per_step": round(1e3 * slowest / length, 2),
        }
        log.info("%d engines x %dx%d: %.2f s, %.0f tokens/s", n, k, length, slowest, n * k * length / slowest)
    for j, v in enumerate(variants if pareto else (), start=len(points)):
        slowest = max(got[i][j] for i in range(n))
        out[f"pareto/{v}"] = {"s_each": [round(got[i][j], 3) for i in range(n)], "s": round(slowest, 3)}
        log.info("%d engines, the Pareto batch, %s: %.2f s", n, v, slowest)
    return {"engines": n, "points": out, **({"pareto_tokens": sum(pareto)} if pareto else {})}


def model_and_prompts(cfg, shape: str, models: str, prompt_len: int) -> tuple[str, list[list[int]]]:
    """A Qwen2.5-shaped model (random weights, full vocabulary; random prompt ids), or the embedded one with
    its validation prompts."""
    import random

    if shape:
        from bench.qwen_shapes import build_model_dir

        rng = random.Random(0)
        prompts = [[rng.randrange(1000, 100_000) for _ in range(prompt_len)] for _ in range(64)]
        return build_model_dir(shape, models), prompts
    from transformers import AutoTokenizer

    from app.driver import resolve_inputs

    inputs = resolve_inputs(cfg)
    tok = AutoTokenizer.from_pretrained(inputs.model_path)
    return inputs.model_path, [tok.encode(r.prompt, add_special_tokens=False) for r in inputs.val_rows[:64]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default="16x32,8x32,1x32", help="KxL,...: K requests of L tokens each")
    ap.add_argument("--variants", default="ours,noseed,nolp,greedy", help=",".join(VARIANTS))
    ap.add_argument("--shape", default="", help="a Qwen2.5 shape (bench/qwen_shapes.py), e.g. 1.5B")
    ap.add_argument("--models", default="/tmp/relay-bench-models", help="where --shape models are built")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens with --shape")
    ap.add_argument("--gpu", action="store_true", help="vLLM on the GPU with CUDA graphs (configs/gpu2.yaml)")
    ap.add_argument("--max-num-seqs", type=int, default=0, help="0: the config's rollout.max_num_seqs")
    ap.add_argument("--engines", type=int, default=1, help="engines sharing the GPU, each its own process")
    ap.add_argument(
        "--pareto", default="", help="GROUPSxN:ALPHA:MIN:MAX: the variants run on this long-tailed batch"
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    points = parse_points(args.points)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if unknown := [v for v in variants if v not in VARIANTS]:
        ap.error(f"unknown variants {unknown}; choose from {sorted(VARIANTS)}")
    pareto = pareto_lengths(args.pareto) if args.pareto else None
    longest = max([length for _, length in points] + (pareto or []))
    overrides = ["ray.name=bench", f"rollout.max_model_len={args.prompt_len + longest + 64}"]
    if args.max_num_seqs:
        overrides.append(f"rollout.max_num_seqs={args.max_num_seqs}")
    cfg = load_config("gpu2" if args.gpu else None, overrides)
    r = cfg.rollout
    if not args.gpu:
        os.environ.update(vla.cpu_env(r.kv_cache_gib))
    model_path, prompts = model_and_prompts(cfg, args.shape, args.models, args.prompt_len)
    engine_kw = dict(
        model_path=model_path,
        dtype=cfg.model.dtype,
        max_model_len=r.max_model_len,
        max_num_seqs=r.max_num_seqs,
        gpu_memory_utilization=memory_share(r),  # the engine takes it on a GPU only
        seed=cfg.seed,
        use_gpu=args.gpu,
        cuda_graphs=args.gpu and r.cuda_graphs,
    )
    if args.engines > 1:
        result = measure_shared(engine_kw, prompts, points, args.engines, variants, pareto)
    else:
        result = asyncio.run(measure(engine_kw, prompts, points, variants, pareto))
    head = {"bench": "engine_step_cost", "model": args.shape or "embedded", "gpu": args.gpu}
    sys.stdout.write(json.dumps({**head, "max_num_seqs": r.max_num_seqs, **result}) + "\n")


if __name__ == "__main__":
    main()
