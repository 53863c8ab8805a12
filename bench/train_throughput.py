"""FSDP2 GRPO step throughput: `Learner.step` (app/trainer/learner.py) on Qwen2-shaped models, old path vs new.

One process per GPU (NCCL default group, as under Ray Train; `--gpus 1` for world size 1); rank 0 builds a
randomly initialised Qwen2 model of each size (Qwen2.5 shapes, real vocabulary), saves it, and every rank
loads it through `Learner` (FSDP2 `fully_shard` per decoder layer, bf16 compute, fp32 master weights, AdamW).
Each step trains one fixed batch of sequences of `prompt + response` tokens; `--response-spread s` draws
response lengths uniformly from [(1-s) R, R] (0: equal lengths, as in earlier runs).

Variants (`--variants`, comma separated; levers appended with `+`):
  padded_full     the reference path: padded micro-batches of sequences, full float32 logits
  padded_chunked  padded micro-batches, chunked log-probs (`train.logprob_chunk_tokens`)
  packed_full     packed micro-batches (`train.micro_batch_tokens`), full logits of the scored tokens
  packed_chunked  packed and chunked (the default of 2026-11-24)
  default         the config's defaults as they are now
  The four named layouts keep the second round's levers off (eager layers, foreach AdamW, a gather and a
  reduce-scatter per micro-batch, 1,024-token log-prob chunks, 8,192 tokens per pass) unless a lever turns
  one on; `default` takes every default.
  levers: +noreshard (`train.reshard_after_forward=false`), +bf16reduce (`train.reduce_dtype=bfloat16`),
          +noentropy (`train.log_entropy=false`), +ac / +noac (activation checkpointing, overriding --ac),
          +fused / +foreach (`train.optimizer_impl`), +gather / +gatherparams / +nogather (`train.gather_once`),
          +compile / +nocompile (`train.compile`), +mtN (`train.micro_batch_tokens=N`),
          +chunkN (`train.logprob_chunk_tokens=N`)
Both layouts get the same token budget per pass: `--micro-tokens` (or +mtN; 0: the config's default) for
packed, `max(1, micro_tokens // seq_len)` sequences for padded.

Model FLOPs per step: 6 * N * tokens (N matmul parameters: every parameter except the input embedding,
which is only read; with tied embeddings the shared matrix is the output projection) + 12 * layers * hidden
* sum(seq_len^2) (attention scores and values, forward and backward, counted in full). MFU = model FLOP/s per
GPU over the GPU's dense bf16 peak (989 TFLOP/s for H100/H200 SXM; --peak-tflops otherwise). Recomputation
under activation checkpointing is not counted. `mfu_needed` also leaves out the output projection of
prompt tokens, which GRPO never scores (the new path skips it).

    python bench/train_throughput.py --gpus 1 --sizes 0.5B --variants padded_full,packed_chunked
    python bench/train_throughput.py --device cpu --sizes tiny --seq-lens 16+48 --tokens-per-step 1024

`--seq-lens` takes `P+R` (prompt + response) or a total T (prompt T/4, response 3T/4). The last line
printed is one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
for p in (str(ROOT), str(Path(__file__).resolve().parent)):
    if p not in sys.path:
        sys.path.insert(0, p)

from qwen_shapes import QWEN2_SHAPES, qwen2_config  # noqa: E402

from app.infra.resources import cuda_alloc_env  # noqa: E402

PEAKS_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "H20": 148.0, "A100": 312.0}
# the first round's settings (2026-11-24): what the named layouts measure unless a lever says otherwise
ROUND1 = [
    "train.compile=off",
    "train.optimizer_impl=foreach",
    "train.gather_once=off",
    "train.logprob_chunk_tokens=1024",
]
ROUND1_MICRO_TOKENS = 8192
BASES = {
    "padded_full": [*ROUND1, "train.micro_batch_tokens=0", "train.logprob_chunk_tokens=0"],
    "padded_chunked": [*ROUND1, "train.micro_batch_tokens=0"],
    "packed_full": [*ROUND1, "train.logprob_chunk_tokens=0"],
    "packed_chunked": ROUND1,
    "default": [],
}
LEVERS = {
    "noreshard": ["train.reshard_after_forward=false"],
    "bf16reduce": ["train.reduce_dtype=bfloat16"],
    "noentropy": ["train.log_entropy=false"],
    "fused": ["train.optimizer_impl=fused"],
    "foreach": ["train.optimizer_impl=foreach"],
    "gather": ["train.gather_once=on"],
    "gatherparams": ["train.gather_once=params"],
    "nogather": ["train.gather_once=off"],
    "compile": ["train.compile=on"],
    "nocompile": ["train.compile=off"],
    "ac": [],
    "noac": [],
}
NUMBERED = {"mt": "train.micro_batch_tokens", "chunk": "train.logprob_chunk_tokens"}


def parse_seq_len(spec: str) -> tuple[int, int]:
    """`P+R` or a total `T` (prompt T/4, response the rest) -> (prompt, response)."""
    if "+" in spec:
        p, r = spec.split("+")
        return int(p), int(r)
    t = int(spec)
    return t // 4, t - t // 4


def _lever(lv: str) -> list[str] | None:
    if lv in LEVERS:
        return LEVERS[lv]
    for prefix, key in NUMBERED.items():
        if lv.startswith(prefix) and lv[len(prefix) :].isdigit():
            return [f"{key}={int(lv[len(prefix) :])}"]
    return None


def variant_overrides(variant: str, seq_len: int, micro_tokens: int) -> tuple[list[str], bool | None, int]:
    """Config overrides of a variant, its activation-checkpointing lever (None: --ac decides) and its token
    budget per pass. Later overrides win: budget, then the base layout, then the levers."""
    from app.config import TrainConfig

    base, *levers = variant.split("+")
    if base not in BASES or any(_lever(lv) is None for lv in levers):
        raise SystemExit(
            f"unknown variant {variant!r}: bases {sorted(BASES)}, levers {sorted(LEVERS)}, mtN, chunkN"
        )
    budget = micro_tokens or (TrainConfig().micro_batch_tokens if base == "default" else ROUND1_MICRO_TOKENS)
    budget = next((int(lv[2:]) for lv in levers if lv.startswith("mt") and lv[2:].isdigit()), budget)
    keys = [f"train.micro_batch_size={max(1, budget // seq_len)}", f"train.micro_batch_tokens={budget}"]
    keys += BASES[base] + [k for lv in levers if not lv.startswith("mt") for k in (_lever(lv) or [])]
    ac = True if "ac" in levers else False if "noac" in levers else None
    return keys, ac, budget


def build_model(size: str, path: Path, max_len: int, dev: torch.device, dtype: torch.dtype) -> None:
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    with dev:
        model = Qwen2ForCausalLM(qwen2_config(size, max(4096, max_len)))
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def make_batch(vocab: int, seqs: int, n: int, prompt: int, response: int, spread: float):
    """`seqs` sequences in groups of `n` (one prompt each); response lengths in [(1-spread) R, R]."""
    from app.records import Batch, Group, Sample

    g = torch.Generator().manual_seed(0)
    out = []
    for gi in range(max(1, seqs // n)):
        p = torch.randint(3, vocab, (prompt,), generator=g).tolist()
        samples = []
        for si in range(min(n, seqs)):
            lo = max(1, int(round(response * (1 - spread))))
            r = int(torch.randint(lo, response + 1, (1,), generator=g))
            samples.append(
                Sample(
                    token_ids=torch.randint(3, vocab, (r,), generator=g).tolist(),
                    logprobs=[-1.0] * r,
                    versions=[0] * r,
                    finish_reason="length",
                    reward=float(si % 2),
                )
            )
        out.append(Group(uid=f"g{gi}", prompt_ids=p, answer="", samples=samples))
    return Batch(groups=out)


def step_flops(model: torch.nn.Module, size: str, batch: Any) -> tuple[float, float, int]:
    """(model FLOPs of one step, the same without prompt tokens' output projection, parameter count)."""
    h, _inter, layers, _heads, _kv, vocab, tied = QWEN2_SHAPES[size]
    n_total = sum(p.numel() for p in model.parameters())  # DTensor numel is the global one
    n_embed = model.get_input_embeddings().weight.numel()
    n_matmul = n_total if tied else n_total - n_embed
    lens = [len(g.prompt_ids) + len(s.token_ids) for g in batch.groups for s in g.samples]
    prompt_tokens = sum(len(g.prompt_ids) for g in batch.groups for _ in g.samples)
    flops = 6.0 * n_matmul * sum(lens) + 12.0 * layers * h * sum(x * x for x in lens)
    return flops, flops - 6.0 * vocab * h * prompt_tokens, n_total


def rank_main(rank: int, world: int, port: int, args: dict[str, Any], out: Any) -> None:
    try:
        _rank_main(rank, world, port, args, out)
    except BaseException as e:
        import traceback

        out.put({"rank": rank, "error": f"{e}\n{traceback.format_exc()}"})
        raise


def _init(rank: int, world: int, port: int, device: str) -> torch.device:
    if device == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        extra: dict[str, Any] = {"device_id": dev}
    else:
        dev, extra = torch.device("cpu"), {}
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=1800),
        **extra,
    )
    return dev


def _rank_main(rank: int, world: int, port: int, args: dict[str, Any], out: Any) -> None:
    dev = _init(rank, world, port, args["device"])
    max_len = max(sum(parse_seq_len(s)) for s in args["seq_lens"])
    dtype = torch.bfloat16 if args["device"] == "cuda" else torch.float32
    try:
        for size in args["sizes"]:
            path = Path(args["workdir"]) / size
            t0 = time.perf_counter()
            if rank == 0:
                build_model(size, path, max_len, dev, dtype)
            dist.barrier()
            build_s = time.perf_counter() - t0
            for spec in args["seq_lens"]:
                for variant in args["variants"]:
                    for ac in args["ac"]:
                        try:
                            row = run_case(rank, world, dev, args, size, path, spec, variant, ac, out)
                        except torch.OutOfMemoryError:  # one case out of memory: say so, go on with the rest
                            row = {"size": size, "seq": spec, "variant": variant, "oom": True}
                        if row is not None and row.get("oom"):
                            gc.collect()  # outside the except block: the traceback no longer holds the tensors
                            torch.cuda.empty_cache()
                        if row is not None and rank == 0:
                            out.put({**row, "build_s": build_s})
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    finally:
        dist.destroy_process_group()
    out.put({"rank": rank, "done": True})


def _auto_ac(size: str, tokens_per_pass: int, dev: torch.device) -> bool:
    """Activation checkpointing where a pass's activations (~70 bytes per token, layer and hidden unit
    in bf16) would not fit in about half the GPU's memory."""
    if dev.type != "cuda":
        return False
    h, _inter, layers, *_ = QWEN2_SHAPES[size]
    return 70.0 * tokens_per_pass * layers * h > 0.5 * torch.cuda.get_device_properties(dev).total_memory


def run_case(
    rank: int,
    world: int,
    dev: torch.device,
    args: dict[str, Any],
    size: str,
    path: Path,
    spec: str,
    variant: str,
    ac: Any,
    out: Any,
) -> dict[str, Any] | None:
    """Load a Learner for one (size, sequence length, variant, checkpointing) and time its steps."""
    from app.config import load_config
    from app.trainer.learner import Learner

    prompt, response = parse_seq_len(spec)
    seq_len = prompt + response
    keys, lever_ac, budget = variant_overrides(variant, seq_len, args["micro_tokens"])
    ac = (
        lever_ac
        if lever_ac is not None
        else (_auto_ac(size, max(seq_len, budget), dev) if ac == "auto" else ac)
    )
    seqs = max(1, args["tokens_per_step"] // seq_len)
    batch = make_batch(QWEN2_SHAPES[size][5], seqs, min(args["n"], seqs), prompt, response, args["spread"])
    cfg = load_config(
        None,
        [
            f"model.dtype={'bfloat16' if dev.type == 'cuda' else 'float32'}",
            f"train.use_gpu={str(dev.type == 'cuda').lower()}",
            f"train.workers={world}",
            f"train.activation_checkpointing={str(ac).lower()}",
            "train.lr=1e-6",
            *keys,
        ],
    )
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    learner = Learner(cfg, str(path), dev)
    load_s = time.perf_counter() - t0
    flops, flops_needed, n_params = step_flops(learner.model, size, batch)
    times, m = time_steps(learner, batch, dev, args["warmup"], args["steps"])
    if args["profile"] and size == args["sizes"][0] and spec == args["seq_lens"][0]:
        profile_step(learner, batch, dev, rank, f"{size} {spec} {variant} AC={ac}", out)
    peak = torch.tensor(
        [torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0.0], device=dev
    )
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    del learner
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if rank != 0:
        return None
    step_s = statistics.median(times)
    tokens = sum(len(g.prompt_ids) + len(s.token_ids) for g in batch.groups for s in g.samples)
    resp = sum(len(s.token_ids) for g in batch.groups for s in g.samples)
    tflops_gpu = flops / step_s / world / 1e12
    return {
        "size": size,
        "seq": f"{prompt}+{response}",
        "variant": variant,
        "activation_checkpointing": ac,
        "params": n_params,
        "step_s": step_s,
        "step_s_all": times,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_s,
        "response_tokens_per_s": resp / step_s,
        "model_tflops_per_gpu": tflops_gpu,
        "mfu": tflops_gpu / args["peak_tflops"],
        "mfu_needed": flops_needed / step_s / world / 1e12 / args["peak_tflops"],
        "peak_mem_gib": float(peak.item()),
        "load_s": load_s,
        "loss": m["loss/policy"],
        "entropy": m["actor/entropy"],
        "grad_norm": m["actor/grad_norm"],
    }


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_steps(
    learner: Any, batch: Any, dev: torch.device, warmup: int, steps: int
) -> tuple[list[float], dict]:
    times, m = [], {}
    for i in range(warmup + steps):
        _sync(dev)
        dist.barrier()
        t0 = time.perf_counter()
        m = learner.step(batch)
        _sync(dev)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times, m


def profile_step(learner: Any, batch: Any, dev: torch.device, rank: int, label: str, out: Any) -> None:
    """One step under the profiler; rank 0 sends the top ops by device and by CPU time, and counts."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        learner.step(batch)
        _sync(dev)
    if rank != 0:
        return
    avg = prof.key_averages()
    tables = {}
    for key in ("device_time_total", "cpu_time_total") if dev.type == "cuda" else ("cpu_time_total",):
        try:
            tables[key] = avg.table(sort_by=key, row_limit=25)
        except Exception as e:  # sort keys differ between torch versions
            tables[key] = f"(no table by {key}: {e})"
    counts = {
        e.key: e.count
        for e in avg
        if e.key
        in (
            "aten::item",
            "aten::_local_scalar_dense",
            "cudaStreamSynchronize",
            "cudaLaunchKernel",
            "cuLaunchKernel",
            "cudaLaunchKernelExC",
        )
    }
    if dev.type == "cuda":  # kernel time summed over the step (overlapping streams counted twice)
        counts["device_self_ms"] = round(sum(e.self_device_time_total for e in avg) / 1e3, 1)
    counts["cpu_self_ms"] = round(sum(e.self_cpu_time_total for e in avg) / 1e3, 1)
    out.put({"profile": label, "tables": tables, "counts": counts})


def parse_args() -> tuple[argparse.Namespace, dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--sizes", default="0.5B,1.5B,3B")
    ap.add_argument("--seq-lens", default="256+768", help="comma separated: P+R or a total T")
    ap.add_argument("--variants", default="padded_full,packed_chunked")
    ap.add_argument(
        "--ac", choices=["both", "on", "off", "auto"], default="auto", help="activation checkpointing"
    )
    ap.add_argument("--gpus", type=int, default=0, help="0: every visible GPU")
    ap.add_argument("--tokens-per-step", type=int, default=65536, help="sequences per step: this / seq_len")
    ap.add_argument("--n", type=int, default=8, help="samples per group")
    ap.add_argument("--response-spread", type=float, default=0.0, help="response lengths in [(1-s) R, R]")
    ap.add_argument(
        "--micro-tokens",
        type=int,
        default=0,
        help="tokens per forward/backward pass (0: the config's default)",
    )
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="dense bf16 peak per GPU")
    ap.add_argument("--workdir", default="", help="where models are written (default: a temp dir)")
    ap.add_argument(
        "--profile", action="store_true", help="profile one step per variant of the first size and length"
    )
    ap.add_argument(
        "--alloc-conf",
        default="auto",
        help="PYTORCH_CUDA_ALLOC_CONF of the ranks, as train.cuda_alloc_conf (auto: expandable segments)",
    )
    ns = ap.parse_args()
    if ns.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("train_throughput needs CUDA GPUs (or --device cpu)")
    if ns.device == "cuda":
        name = torch.cuda.get_device_name(0)
        world = ns.gpus or torch.cuda.device_count()
        peak = ns.peak_tflops or next((v for k, v in PEAKS_TFLOPS.items() if k in name), 989.0)
    else:
        name, world, peak = "cpu", max(1, ns.gpus), ns.peak_tflops or 1.0
    args = {
        "device": ns.device,
        "device_name": name,
        "world": world,
        "sizes": ns.sizes.split(","),
        "seq_lens": ns.seq_lens.split(","),
        "variants": ns.variants.split(","),
        "ac": {"both": [False, True], "on": [True], "off": [False], "auto": ["auto"]}[ns.ac],
        "tokens_per_step": ns.tokens_per_step,
        "n": ns.n,
        "spread": ns.response_spread,
        "micro_tokens": ns.micro_tokens,
        "steps": ns.steps,
        "warmup": ns.warmup,
        "peak_tflops": peak,
        "workdir": ns.workdir or tempfile.mkdtemp(prefix="relay-train-bench-"),
        "profile": ns.profile,
        "alloc_env": cuda_alloc_env(ns.alloc_conf) if ns.device == "cuda" else {},
    }
    for v in args["variants"]:
        variant_overrides(v, 1, 1)  # fail early on a typo
    return ns, args


def collect(procs: list, out: Any, world: int) -> tuple[list[dict], bool]:
    """Print results as they come; returns the result rows and whether every rank finished cleanly."""
    rows, done, failed = [], 0, False
    while done < world and not failed:
        try:
            m = out.get(timeout=10)
        except Exception:
            failed = any(p.exitcode not in (None, 0) for p in procs)
            continue
        if "error" in m:
            print(f"rank {m['rank']} failed: {m['error']}", file=sys.stderr)
            failed = True
        elif m.get("done"):
            done += 1
        elif "profile" in m:
            for key, table in m["tables"].items():
                print(f"one step of {m['profile']} under the profiler, by {key}:\n{table}", flush=True)
            print(f"counts in that step: {m['counts']}", flush=True)
        elif m.get("oom"):
            print(f"{m['size']:>5s} {m['seq']:>10s} {m['variant']:<28s} out of memory", flush=True)
        else:
            rows.append(m)
            print(
                f"{m['size']:>5s} {m['seq']:>10s} {m['variant']:<28s} AC={'on ' if m['activation_checkpointing'] else 'off'} "
                f"step {m['step_s']:.3f}s  {m['tokens_per_s']:,.0f} tok/s  {m['model_tflops_per_gpu']:.0f} TFLOP/s/GPU  "
                f"MFU {100 * m['mfu']:.1f}% (needed {100 * m['mfu_needed']:.1f}%)  peak {m['peak_mem_gib']:.1f} GiB  "
                f"loss {m['loss']:.5f}  (load {m['load_s']:.0f}s)",
                flush=True,
            )
    return rows, not failed and done == world


def main() -> None:
    ns, args = parse_args()
    import torch.multiprocessing as mp

    from app.weights.group import free_port

    os.environ.update(args["alloc_env"])  # the spawned ranks' allocator, as the trainer workers get it
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    t_start = time.time()
    world = args["world"]
    procs = [ctx.Process(target=rank_main, args=(r, world, port, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    rows, ok = collect(procs, out, world)
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
    if not ns.workdir:
        shutil.rmtree(args["workdir"], ignore_errors=True)

    def key(r: dict) -> str:
        return f"{r['size']}/{r['seq']}/{r['variant']}{'+ac' if r['activation_checkpointing'] else ''}"

    summary = {
        "bench": "train_throughput",
        "device": args["device_name"],
        "gpus": world,
        "torch": torch.__version__,
        "peak_tflops_per_gpu": args["peak_tflops"],
        "alloc_env": args["alloc_env"],
        "batch": {k: args[k] for k in ("tokens_per_step", "n", "spread", "micro_tokens")},
        "steps": args["steps"],
        "warmup": args["warmup"],
        "wall_s": round(time.time() - t_start, 1),
        "ok": ok,
        "results": rows,
        "mfu": {key(r): round(r["mfu"], 4) for r in rows},
        "tokens_per_s": {key(r): round(r["tokens_per_s"]) for r in rows},
        "peak_mem_gib": {key(r): round(r["peak_mem_gib"], 1) for r in rows},
    }
    print(json.dumps(summary))
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
