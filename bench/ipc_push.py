"""CUDA-IPC weight push into a real vLLM engine on the same GPU, against a raw device-to-device copy.

    python bench/ipc_push.py [--shapes 0.5b,1.5b,3b] [--pushes 3] [--bucket-mb 1024]

For each Qwen2.5 shape: a vLLM AsyncLLM with random (dummy) weights and Relay's worker extension, and, in this
process, a bf16 state dict of the same names on the same GPU (the trainer's side). Each push: the IPC
transport (app/weights/ipc.py) as rank 0 and the engine's worker as rank 1, exactly as a replica receives it
(pause in keep mode with requests in flight, receive and load, set the version, resume), for each way of
loading (`--loads`: slots, load_weights, layerwise reload). Reports the push time (trainer walk and the
replica's pause), the raw copy of the same bytes, that the checksums match, and that every way of loading
left the same parameters. Prints one JSON line per shape.

The generation pause as a client sees it: a probe request streams its tokens through the pushes, and each
push's token gap (the longest wait between two of the probe's tokens across the push) is set against the
engine's steady step (the median wait between tokens away from pushes). `lost_s` = gap - step is the
generation time the push took away: the pause call's wait for the step in flight is not in it (that step
still produces tokens), the load and the recompute of the frozen requests' KV cache after it are.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {  # Qwen2.5 configs: hidden, layers, intermediate, heads, kv heads
    "0.5b": (896, 24, 4864, 14, 2),
    "1.5b": (1536, 28, 8960, 12, 2),
    "3b": (2048, 36, 11008, 16, 2),
}


def model_dir(shape: str) -> str:
    from transformers import Qwen2Config

    h, n, inter, heads, kv = SHAPES[shape]
    cfg = Qwen2Config(
        hidden_size=h,
        num_hidden_layers=n,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=151936,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        architectures=["Qwen2ForCausalLM"],
    )
    path = Path(tempfile.mkdtemp(prefix=f"relay-{shape}-"))
    cfg.save_pretrained(path)
    return str(path)


def trainer_state(path: str) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    return {
        k: (torch.randn(p.shape, device="cuda", generator=g, dtype=torch.float32) * 0.02).to(torch.bfloat16)
        for k, p in m.named_parameters()
    }


async def push(engine, state: dict, version: int, bucket_mb: float, loop, load: str) -> dict:
    """One push as ReplicaSync does it: pause(keep) -> relay_receive -> set version -> resume."""
    from app.rollout.partial import partial_policy
    from app.vllm import engine as vla
    from app.weights.buckets import plan_buckets
    from app.weights.records import plan_to_json

    plan = plan_buckets(
        [(k, tuple(v.shape), v.dtype) for k, v in state.items()], int(bucket_mb * 2**20), version
    )
    box: dict = {}
    t0 = time.perf_counter()

    def send() -> None:
        box["stats"] = SENDER.send(plan, lambda names: [state[n] for n in names], "cuda")

    th = threading.Thread(target=send)
    th.start()
    await vla.pause(engine, partial_policy("keep"), RECOMPUTE_KV)
    t_paused = time.perf_counter()
    res = await vla.rpc(engine, "relay_receive", plan_json=plan_to_json(plan), load=load)
    await vla.set_version(engine, version)
    await vla.resume(engine)
    t1 = time.perf_counter()
    await loop.run_in_executor(None, th.join)
    t2 = time.perf_counter()
    stats = box["stats"]
    return {
        "window": (t0, t1),  # when generation was stopped, for the probe's token gaps
        "push_s": max(t1, t2) - t0,
        "pause_s": t1 - t0,  # generation stopped: pause call to resume's return
        "pause_call_s": t_paused - t0,
        "trainer_walk_s": stats.total_s,
        "receive_transfer_s": res[0]["transfer_s"],
        "receive_load_s": res[0]["load_s"],
        "receive_s": res[0]["receive_s"],
        "load": res[0]["load"],
        "checksums_match": res[0]["checksums"] == stats.checksums,
        "nbytes": stats.nbytes,
        "buckets": stats.buckets,
    }


async def probe(engine, stamps: list[float], stop: asyncio.Event) -> None:
    """Stream one request's tokens, recording when each output arrives, until `stop` (new requests when one
    ends)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        n=1,
        max_tokens=1900,
        temperature=1.0,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
        detokenize=False,
    )
    k = 0
    while not stop.is_set():
        k += 1
        async for _ in engine.generate({"prompt_token_ids": [5, 6, 7, 8] * 4}, params, f"probe-{k}"):
            stamps.append(time.perf_counter())
            if stop.is_set():
                await engine.abort(f"probe-{k}")
                break


def token_gaps(
    stamps: list[float], windows: list[tuple[float, float]], every: list[tuple[float, float]]
) -> dict:
    """Per push window (start, end) of `windows`: the longest wait between consecutive probe tokens that
    overlaps it; the steady step: the median wait between tokens that overlap none of `every` push's window
    (warm-up pushes and other ways of loading included)."""
    waits = list(itertools.pairwise(stamps))

    def overlaps(a: float, b: float, w: tuple[float, float]) -> bool:
        return b > w[0] and a < w[1]

    steady = [b - a for a, b in waits if not any(overlaps(a, b, w) for w in every)]
    step = statistics.median(steady) if steady else float("nan")
    gaps = [max((b - a for a, b in waits if overlaps(a, b, w)), default=float("nan")) for w in windows]
    return {
        "step_s": round(step, 5),
        "gap_s": [round(g, 4) for g in gaps],
        "lost_s": [round(g - step, 4) for g in gaps],
    }


def raw_copy_s(state: dict) -> float:
    import torch

    dst = {k: torch.empty_like(v) for k, v in state.items()}
    best = 1e9
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k, v in state.items():
            dst[k].copy_(v)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


SENDER = None
CUDA_GRAPHS = False
GAP_S = 0.3  # between pushes
RECOMPUTE_KV = True  # rollout.recompute_kv


def _differ(digests: dict[str, dict]) -> dict[str, list[str]]:
    """For each way of loading after the first, the engine parameters whose checksum differs from the first's."""
    loads = list(digests)
    if not loads:
        return {}
    first = digests[loads[0]]
    return {
        load: sorted(n for n in set(first) | set(digests[load]) if first.get(n) != digests[load].get(n))[:20]
        for load in loads[1:]
    }


async def bench_shape(shape: str, pushes: int, bucket_mb: float, gpu_util: float, loads: list[str]) -> dict:
    global SENDER
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from app.vllm import engine as vla
    from app.weights.group import free_port
    from app.weights.ipc import IpcTransport
    from app.weights.records import GroupInfo, group_to_json

    path = model_dir(shape)
    args = AsyncEngineArgs(
        model=path,
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=2048,
        enforce_eager=not CUDA_GRAPHS,
        gpu_memory_utilization=gpu_util,
        skip_tokenizer_init=True,
        worker_extension_cls=vla.WORKER_EXTENSION,
    )
    engine = AsyncLLM.from_engine_args(args)
    loop = asyncio.get_running_loop()
    try:
        state = trainer_state(path)
        info = GroupInfo(
            epoch=0,
            host="127.0.0.1",
            port=free_port(),
            world=2,
            backend="gloo",
            timeout_s=60,
            ranks={},
            transport="ipc",
        )
        SENDER = IpcTransport()
        opened = loop.run_in_executor(None, SENDER.open, info, "cuda")
        await vla.rpc(engine, "relay_join", group_json=group_to_json(info), first_rank=1)
        await opened
        await vla.set_version(engine, 0)
        gen = [
            asyncio.ensure_future(
                vla.generate(
                    engine,
                    [1, 2, 3, 4] * 8,
                    n=4,
                    max_tokens=1000,
                    temperature=1.0,
                    top_p=1.0,
                    version=0,
                    ignore_eos=True,
                )
            )
            for _ in range(16)
        ]
        stamps: list[float] = []
        stop = asyncio.Event()
        prober = asyncio.ensure_future(probe(engine, stamps, stop))
        await asyncio.sleep(0.5)  # requests in flight: the pause freezes them (keep)
        runs: dict[str, list[dict]] = {}
        digests: dict[str, dict] = {}
        version = 0
        for load in loads:
            runs[load] = []
            for _ in range(pushes + 1):  # the first push of a mode warms up (and maps the staging buffer)
                version += 1
                in_flight = sum(not g.done() for g in gen)
                r = await push(engine, state, version, bucket_mb, loop, load=load)
                runs[load].append({**r, "requests_in_flight": in_flight})
                await asyncio.sleep(GAP_S)  # steady steps between pushes, and a push lands anywhere in a step
            # the same state was pushed: every way of loading must leave the same parameters
            digests[load] = (await vla.rpc(engine, "relay_params_digest"))[0]
        stop.set()
        await prober
        outs = await asyncio.gather(*gen)
        versions = sorted({v for o in outs for s in o for v in s["versions"]})
        raw = raw_copy_s(state)
        SENDER.close()
    finally:
        vla.shutdown(engine)
    out = {
        "bench": "ipc_push",
        "shape": shape,
        "cuda_graphs": CUDA_GRAPHS,
        "recompute_kv": RECOMPUTE_KV,
        "raw_copy_s": round(raw, 5),
        "token_versions_seen": versions,
        "params_equal_across_loads": len({json.dumps(d, sort_keys=True) for d in digests.values()}) == 1,
        "params_differ": _differ(digests),
        "params": len(next(iter(digests.values()), {})),
    }
    windows = {load: [r.pop("window") for r in rs] for load, rs in runs.items()}
    every = [w for ws in windows.values() for w in ws]
    for load, rs in runs.items():
        gaps = token_gaps(stamps, windows[load][1:], every)
        best = min(rs[1:], key=lambda r: r["push_s"])
        out[load] = {
            "token_gap": gaps,
            "push_median_s": round(statistics.median(r["push_s"] for r in rs[1:]), 4),
            "push_s": [round(r["push_s"], 4) for r in rs],
            "pause_s": [round(r["pause_s"], 4) for r in rs],
            "best": best,
            "push_over_raw": round(best["push_s"] / raw, 1),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="0.5b,1.5b,3b")
    ap.add_argument("--pushes", type=int, default=3)
    from app.config.weights import IpcSyncConfig

    ap.add_argument(
        "--bucket-mb", type=float, default=IpcSyncConfig.bucket_mb, help="default: sync.ipc.bucket_mb"
    )
    ap.add_argument("--gpu-util", type=float, default=0.4)
    ap.add_argument(
        "--loads", default="slots,weights,layerwise", help="slots (the GPU default), weights, layerwise"
    )
    ap.add_argument("--cuda-graphs", action="store_true", help="the engine captures CUDA graphs")
    ap.add_argument(
        "--keep-kv", action="store_true", help="rollout.recompute_kv=false: frozen requests keep KV"
    )
    a = ap.parse_args()
    global CUDA_GRAPHS, RECOMPUTE_KV
    CUDA_GRAPHS, RECOMPUTE_KV = a.cuda_graphs, not a.keep_kv
    for shape in a.shapes.split(","):
        res = asyncio.run(bench_shape(shape, a.pushes, a.bucket_mb, a.gpu_util, a.loads.split(",")))
        sys.stdout.write(json.dumps(res) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
