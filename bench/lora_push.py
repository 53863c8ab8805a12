"""LoRA push against a full-weight push: bytes and time of app/weights/'s bucketed, checksummed push.

Two processes over one stateless process group (gloo on CPU, NCCL on GPUs): a sender walks the plan with
`send_buckets` (the tensors already sit on it: no FSDP2 gather), a receiver runs `receive_buckets`. For the
full weights the receiver copies each tensor into its own copy (what a vLLM worker's load does); for LoRA it
copies them out and writes the PEFT folder a replica hands to vLLM's `add_lora` (`app.trainer.lora.save_adapter`),
which is included in the time. vLLM's own `add_lora` is not included (it needs an engine: see the integration test).

Shapes: `embedded` is the built-in tiny Qwen2 (float32, as the CPU run trains it); `1.5B` is Qwen2-1.5B's shape
(bfloat16). LoRA rank `--rank` (16) on q,k,v,o,gate,up,down of every layer, in the pushed dtype.

    python bench/lora_push.py --cpu                     # both shapes over gloo on this machine's CPU
    python bench/lora_push.py --cpu --sizes embedded --reps 3

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from app.trainer.lora import LoraSpec, save_adapter  # noqa: E402
from app.weights.broadcast import receive_buckets, send_buckets  # noqa: E402
from app.weights.buckets import plan_buckets  # noqa: E402
from app.weights.group import StatelessGroup, free_port  # noqa: E402
from bench.qwen_shapes import QWEN2_SHAPES  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# hidden, intermediate, layers, heads, kv heads, vocab, tied (the built-in tiny model, app/tasks/tiny.py)
SHAPES = {"embedded": ((128, 384, 2, 4, 2, 22, False), "float32"), "1.5B": (QWEN2_SHAPES["1.5B"], "bfloat16")}


def linears(shape: tuple) -> list[tuple[str, int, int]]:
    """(module path, in, out) of every targeted linear layer."""
    h, inter, layers, heads, kv, _, _ = shape
    hd = h // heads
    out = []
    for i in range(layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out += [(a + "q_proj", h, heads * hd), (a + "k_proj", h, kv * hd), (a + "v_proj", h, kv * hd)]
        out += [(a + "o_proj", heads * hd, h), (m + "gate_proj", h, inter), (m + "up_proj", h, inter)]
        out += [(m + "down_proj", inter, h)]
    return out


def full_specs(shape: tuple, dtype: str) -> list[tuple[str, tuple[int, ...], str]]:
    h, _, layers, _, _, vocab, tied = shape
    out = [("model.embed_tokens.weight", (vocab, h), dtype)]
    out += [(f"{p}.weight", (o, i), dtype) for p, i, o in linears(shape)]
    for i in range(layers):
        out += [
            (f"model.layers.{i}.{n}.weight", (h,), dtype)
            for n in ("input_layernorm", "post_attention_layernorm")
        ]
    out.append(("model.norm.weight", (h,), dtype))
    if not tied:
        out.append(("lm_head.weight", (vocab, h), dtype))
    return out


def lora_specs(shape: tuple, dtype: str, rank: int) -> list[tuple[str, tuple[int, ...], str]]:
    out = []
    for p, i, o in linears(shape):
        out += [(f"{p}.lora_A.weight", (rank, i), dtype), (f"{p}.lora_B.weight", (o, rank), dtype)]
    return out


def _worker(rank: int, port: int, args: dict[str, Any], q: Any) -> None:
    try:
        dev = torch.device("cpu") if args["cpu"] else torch.device("cuda", rank)
        if dev.type == "cuda":
            torch.cuda.set_device(rank)
        torch.set_num_threads(1)
        group = StatelessGroup("127.0.0.1", port, rank, 2, "gloo" if args["cpu"] else "nccl", 300.0, 0, dev)
        for size in args["sizes"]:
            shape, dtype = SHAPES[size]
            for kind in ("full", f"lora_r{args['rank']}"):
                specs = full_specs(shape, dtype) if kind == "full" else lora_specs(shape, dtype, args["rank"])
                _one(rank, group, dev, size, kind, specs, args, q)
        group.close()
    except BaseException as e:
        q.put({"rank": rank, "error": repr(e)})
        raise


def _one(
    rank: int, group: Any, dev: torch.device, size: str, kind: str, specs: list, args: dict, q: Any
) -> None:
    dt = getattr(torch, specs[0][2])
    state = {
        n: torch.randn(s, device=dev).to(dt) if rank == 0 else torch.empty(s, dtype=dt, device=dev)
        for n, s, _ in specs
    }
    spec = LoraSpec(args["rank"], 2.0 * args["rank"], 0.0, TARGETS)
    folder = tempfile.mkdtemp(prefix="relay-bench-lora-")
    for i in range(args["warmup"] + args["reps"]):
        plan = plan_buckets(specs, int(args["bucket_mb"] * 2**20), version=i)
        got: dict[str, torch.Tensor] = {}

        def load(items: list, got: dict = got) -> None:
            for name, t in items:
                if kind == "full":
                    state[name].copy_(t)
                else:
                    got[name] = t.to("cpu", copy=True)

        group.barrier()
        t0 = time.monotonic()
        if rank == 0:
            send_buckets(plan, lambda names: [state[n] for n in names], group, dev)
        else:
            receive_buckets(plan, group, load, dev)
            if kind != "full":
                save_adapter(folder, got, spec)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t1 = time.monotonic()
        if i >= args["warmup"]:
            q.put(
                {
                    "rank": rank,
                    "size": size,
                    "kind": kind,
                    "s": t1 - t0,
                    "nbytes": plan.nbytes,
                    "tensors": len(specs),
                    "buckets": len(plan.buckets),
                }
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--cpu", action="store_true", help="gloo on CPU (default where there is no CUDA GPU pair)"
    )
    ap.add_argument("--sizes", default="embedded,1.5B")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=256.0)
    a = ap.parse_args()
    cpu = a.cpu or torch.cuda.device_count() < 2
    args = {
        "cpu": cpu,
        "sizes": a.sizes.split(","),
        "rank": a.rank,
        "reps": a.reps,
        "warmup": a.warmup,
        "bucket_mb": a.bucket_mb,
    }
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, args, q)) for r in range(2)]
    for p in procs:
        p.start()
    expected = 2 * len(args["sizes"]) * 2 * a.reps
    rows = []
    while len(rows) < expected:
        row = q.get(timeout=1800)
        if "error" in row:
            raise SystemExit(f"rank {row['rank']} failed: {row['error']}")
        rows.append(row)
    for p in procs:
        p.join(60)
    device = (
        f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), gloo"
        if cpu
        else (f"2 x {torch.cuda.get_device_name(0)}, NCCL")
    )
    results: dict[str, dict[str, Any]] = {}
    for size in args["sizes"]:
        for kind in ("full", f"lora_r{a.rank}"):
            mine = [r for r in rows if r["size"] == size and r["kind"] == kind]
            # a push ends when the receiver is done (it received, checksummed and loaded or wrote everything)
            recv = [r["s"] for r in mine if r["rank"] == 1]
            results.setdefault(size, {})[kind] = {
                "bytes": mine[0]["nbytes"],
                "tensors": mine[0]["tensors"],
                "buckets": mine[0]["buckets"],
                "push_ms": round(1000 * statistics.median(recv), 3),
            }
        full, lo = results[size]["full"], results[size][f"lora_r{a.rank}"]
        results[size]["bytes_ratio"] = round(full["bytes"] / lo["bytes"], 1)
        results[size]["time_ratio"] = round(full["push_ms"] / max(lo["push_ms"], 1e-6), 1)
        print(
            f"{size:>9}: full {full['bytes'] / 2**20:10.2f} MiB {full['push_ms']:10.1f} ms | LoRA r{a.rank} "
            f"{lo['bytes'] / 2**20:8.3f} MiB {lo['push_ms']:8.1f} ms (incl. writing the PEFT folder) | "
            f"{results[size]['bytes_ratio']}x fewer bytes, {results[size]['time_ratio']}x faster"
        )
    print(
        json.dumps(
            {"bench": "lora_push", "device": device, "rank": a.rank, "reps": a.reps, "results": results}
        )
    )


if __name__ == "__main__":
    main()
