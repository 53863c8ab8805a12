"""FSDP2 GRPO step throughput on GPUs: `Learner.step` (app/train_loop.py) on Qwen2-shaped models.

One process per GPU (NCCL default group, as under Ray Train); rank 0 builds a randomly initialised Qwen2
model of each size (Qwen2.5 shapes, real vocabulary), saves it, and every rank loads it through `Learner`
(FSDP2 `fully_shard` per decoder layer, bf16 compute, fp32 master weights and gradient reduction, AdamW).
Each step trains one fixed batch of `groups x n` sequences of `prompt + response` tokens (equal lengths, no
padding), with and without activation checkpointing.

Model FLOPs per token: 6 * N (matmul parameters: every parameter except the input embedding, which is only
read; with tied embeddings the shared matrix is the output projection) + 12 * layers * hidden * seq_len
(attention scores and values, forward and backward, counted in full). MFU = model FLOP/s per GPU over the
GPU's dense bf16 peak (989 TFLOP/s for H100/H200 SXM; --peak-tflops otherwise). Recomputation under
activation checkpointing is not counted as useful work.

    python bench/train_throughput.py                       # 0.5B,1.5B,3B on every visible GPU
    python bench/train_throughput.py --sizes 0.5B --ac off --steps 2

The last line printed is one JSON object.
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

from sync_bandwidth import QWEN2_SHAPES  # noqa: E402

PEAKS_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "H20": 148.0, "A100": 312.0}


def qwen2_config(size: str, max_len: int):
    from transformers import Qwen2Config

    h, inter, layers, heads, kv, vocab, tied = QWEN2_SHAPES[size]
    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=max(4096, max_len),
        tie_word_embeddings=tied,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        bos_token_id=None,
        eos_token_id=1,
        pad_token_id=0,
    )


def build_model(size: str, path: Path, max_len: int, dev: torch.device) -> None:
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    with dev:
        model = Qwen2ForCausalLM(qwen2_config(size, max_len))
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    del model
    torch.cuda.empty_cache()


def make_batch(vocab: int, groups: int, n: int, prompt: int, response: int):
    from app.records import Batch, Group, Sample

    g = torch.Generator().manual_seed(0)
    out = []
    for gi in range(groups):
        p = torch.randint(3, vocab, (prompt,), generator=g).tolist()
        samples = [
            Sample(
                token_ids=torch.randint(3, vocab, (response,), generator=g).tolist(),
                logprobs=[-1.0] * response,
                versions=[0] * response,
                finish_reason="length",
                reward=float(si % 2),
            )
            for si in range(n)
        ]
        out.append(Group(uid=f"g{gi}", prompt_ids=p, answer="", samples=samples))
    return Batch(groups=out)


def model_flops_per_token(model: torch.nn.Module, size: str, seq_len: int) -> tuple[float, int]:
    h, _inter, layers, _heads, _kv, _vocab, tied = QWEN2_SHAPES[size]
    n_total = sum(p.numel() for p in model.parameters())  # DTensor numel is the global one
    n_embed = model.get_input_embeddings().weight.numel()
    n_matmul = n_total if tied else n_total - n_embed
    return 6.0 * n_matmul + 12.0 * layers * h * seq_len, n_total


def rank_main(rank: int, world: int, port: int, args: dict[str, Any], out: Any) -> None:
    try:
        _rank_main(rank, world, port, args, out)
    except BaseException as e:
        import traceback

        out.put({"rank": rank, "error": f"{e}\n{traceback.format_exc()}"})
        raise


def _rank_main(rank: int, world: int, port: int, args: dict[str, Any], out: Any) -> None:
    from app.config import load_config
    from app.train_loop import Learner

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=1800),
        device_id=dev,
    )
    seq_len = args["prompt"] + args["response"]
    try:
        for size in args["sizes"]:
            path = Path(args["workdir"]) / size
            t0 = time.perf_counter()
            if rank == 0:
                build_model(size, path, seq_len, dev)
            dist.barrier()
            build_s = time.perf_counter() - t0
            vocab = QWEN2_SHAPES[size][5]
            batch = make_batch(vocab, args["groups"], args["n"], args["prompt"], args["response"])
            for ac in args["ac"]:
                cfg = load_config(
                    None,
                    [
                        "model.dtype=bfloat16",
                        "train.use_gpu=true",
                        f"train.workers={world}",
                        f"train.micro_batch_size={args['micro']}",
                        f"train.activation_checkpointing={str(ac).lower()}",
                        "train.lr=1e-6",
                    ],
                )
                torch.cuda.reset_peak_memory_stats(dev)
                t0 = time.perf_counter()
                learner = Learner(cfg, str(path), dev)
                load_s = time.perf_counter() - t0
                flops_tok, n_params = model_flops_per_token(learner.model, size, seq_len)
                times = []
                for i in range(args["warmup"] + args["steps"]):
                    torch.cuda.synchronize(dev)
                    dist.barrier()
                    t0 = time.perf_counter()
                    m = learner.step(batch)
                    torch.cuda.synchronize(dev)
                    dt = time.perf_counter() - t0
                    if i >= args["warmup"]:
                        times.append(dt)
                if args["profile"] and size == args["sizes"][0] and ac == args["ac"][0]:
                    from torch.profiler import ProfilerActivity, profile

                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        learner.step(batch)
                        torch.cuda.synchronize(dev)
                    if rank == 0:
                        avg = prof.key_averages()
                        tables = {}
                        for key in ("device_time_total", "cpu_time_total"):
                            try:
                                tables[key] = avg.table(sort_by=key, row_limit=18)
                            except Exception as e:  # sort keys differ between torch versions
                                tables[key] = f"(no table by {key}: {e})"
                        out.put({"profile": f"{size} AC={ac}", "tables": tables})
                peak = torch.tensor([torch.cuda.max_memory_allocated(dev) / 2**30], device=dev)
                dist.all_reduce(peak, op=dist.ReduceOp.MAX)
                if rank == 0:
                    step_s = statistics.median(times)
                    tokens = args["groups"] * args["n"] * seq_len
                    resp_tokens = args["groups"] * args["n"] * args["response"]
                    tflops_gpu = flops_tok * tokens / step_s / world / 1e12
                    out.put(
                        {
                            "size": size,
                            "activation_checkpointing": ac,
                            "params": n_params,
                            "step_s": step_s,
                            "step_s_all": times,
                            "tokens_per_step": tokens,
                            "tokens_per_s": tokens / step_s,
                            "response_tokens_per_s": resp_tokens / step_s,
                            "model_tflops_per_gpu": tflops_gpu,
                            "mfu": tflops_gpu / args["peak_tflops"],
                            "peak_mem_gib": float(peak.item()),
                            "load_s": load_s,
                            "build_s": build_s,
                            "loss": m["loss/policy"],
                            "grad_norm": m["actor/grad_norm"],
                        }
                    )
                del learner
                gc.collect()
                torch.cuda.empty_cache()
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    finally:
        dist.destroy_process_group()
    out.put({"rank": rank, "done": True})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="0.5B,1.5B,3B")
    ap.add_argument("--ac", choices=["both", "on", "off"], default="both", help="activation checkpointing")
    ap.add_argument("--gpus", type=int, default=0, help="0: every visible GPU")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--n", type=int, default=8, help="samples per group")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--response", type=int, default=768)
    ap.add_argument("--micro", type=int, default=4, help="train.micro_batch_size (sequences per pass)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="dense bf16 peak per GPU")
    ap.add_argument("--workdir", default="", help="where models are written (default: a temp dir)")
    ap.add_argument(
        "--profile", action="store_true", help="profile one step of the first size, print top ops"
    )
    ns = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("train_throughput needs CUDA GPUs")
    world = ns.gpus or torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    peak = ns.peak_tflops or next((v for k, v in PEAKS_TFLOPS.items() if k in name), 989.0)
    workdir = ns.workdir or tempfile.mkdtemp(prefix="relay-train-bench-")
    args = {
        "sizes": ns.sizes.split(","),
        "ac": {"both": [False, True], "on": [True], "off": [False]}[ns.ac],
        "groups": ns.groups,
        "n": ns.n,
        "prompt": ns.prompt,
        "response": ns.response,
        "micro": ns.micro,
        "steps": ns.steps,
        "warmup": ns.warmup,
        "peak_tflops": peak,
        "workdir": workdir,
        "profile": ns.profile,
    }
    import torch.multiprocessing as mp

    from app.sync import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    t_start = time.time()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, args, out)) for r in range(world)]
    for p in procs:
        p.start()
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
        else:
            rows.append(m)
            print(
                f"{m['size']:>5s} AC={'on ' if m['activation_checkpointing'] else 'off'} "
                f"step {m['step_s']:.3f}s  {m['tokens_per_s']:,.0f} tok/s  "
                f"{m['model_tflops_per_gpu']:.0f} TFLOP/s/GPU  MFU {100 * m['mfu']:.1f}%  "
                f"peak {m['peak_mem_gib']:.1f} GiB  (load {m['load_s']:.0f}s)",
                flush=True,
            )
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
    if not ns.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    summary = {
        "bench": "train_throughput",
        "device": name,
        "gpus": world,
        "torch": torch.__version__,
        "peak_tflops_per_gpu": peak,
        "batch": {k: args[k] for k in ("groups", "n", "prompt", "response", "micro")},
        "steps": args["steps"],
        "warmup": args["warmup"],
        "wall_s": round(time.time() - t_start, 1),
        "ok": not failed and done == world,
        "results": rows,
        "mfu": {
            f"{r['size']}{'+ac' if r['activation_checkpointing'] else ''}": round(r["mfu"], 4) for r in rows
        },
        "tokens_per_s": {
            f"{r['size']}{'+ac' if r['activation_checkpointing'] else ''}": round(r["tokens_per_s"])
            for r in rows
        },
    }
    print(json.dumps(summary))
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
