"""Weight-push bandwidth: app/sync.py's bucketed, checksummed push against a raw broadcast of the same bytes.

Two processes: a sender (GPU0) walks a plan of Qwen2-shaped bf16 tensors with `send_buckets` (a no-op gather:
the tensors already sit on the sender), a receiver (GPU1) runs `receive_buckets` and copies every tensor into
its own preallocated copy (what a vLLM worker's load does). In the same run, one flat tensor of the same
bytes goes through a single raw broadcast. A push's time runs from the sender's start to the receiver's last
load, both read from the host's monotonic clock after a barrier; warm-up repetitions are dropped, the median
of the rest is reported.

Variants (each on both processes): `current` (app/weights/ as it is), `nockpt` (checksums replaced by a no-op:
what verification costs), `legacy` (the checksum and NCCL wait of app/weights/ before the GPU tier, inside
today's walk: int32 words widened to int64 with a materialised weight ramp and two device syncs per bucket,
and `work.wait(timeout)`, which polls with 1 ms sleeps). `--trace SIZE` profiles one push of that size.

    python bench/sync_bandwidth.py                  # GPU: 0.5B,1.5B,3B,7B over NCCL; CPU (no CUDA): tiny over gloo
    python bench/sync_bandwidth.py --cpu --sizes tiny --reps 2

The last line printed is one JSON object (the results and the push/raw ratios).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from app.vllm.fast_load import SlotLoader, plan_slots  # noqa: E402
from app.weights import broadcast as sync_walk  # noqa: E402  (where the push walk looks up the checksum)
from app.weights.broadcast import receive_buckets, send_buckets  # noqa: E402
from app.weights.buckets import pack_into, plan_buckets  # noqa: E402
from app.weights.group import StatelessGroup, free_port  # noqa: E402
from bench.qwen_shapes import QWEN2_SHAPES  # noqa: E402


def qwen2_specs(size: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every parameter of a Qwen2 model, in HF order and naming."""
    h, inter, layers, heads, kv, vocab, tied = QWEN2_SHAPES[size]
    hd = h // heads
    out = [("model.embed_tokens.weight", (vocab, h), "bfloat16")]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (heads * hd, h), "bfloat16"),
            (p + "self_attn.q_proj.bias", (heads * hd,), "bfloat16"),
            (p + "self_attn.k_proj.weight", (kv * hd, h), "bfloat16"),
            (p + "self_attn.k_proj.bias", (kv * hd,), "bfloat16"),
            (p + "self_attn.v_proj.weight", (kv * hd, h), "bfloat16"),
            (p + "self_attn.v_proj.bias", (kv * hd,), "bfloat16"),
            (p + "self_attn.o_proj.weight", (h, heads * hd), "bfloat16"),
            (p + "mlp.gate_proj.weight", (inter, h), "bfloat16"),
            (p + "mlp.up_proj.weight", (inter, h), "bfloat16"),
            (p + "mlp.down_proj.weight", (h, inter), "bfloat16"),
            (p + "input_layernorm.weight", (h,), "bfloat16"),
            (p + "post_attention_layernorm.weight", (h,), "bfloat16"),
        ]
    out.append(("model.norm.weight", (h,), "bfloat16"))
    if not tied:
        out.append(("lm_head.weight", (vocab, h), "bfloat16"))
    return out


# ---------------------------------------------------------------- app/weights/ before the GPU tier (for `legacy`)


def legacy_checksum(flat: torch.Tensor) -> str:
    raw = flat.detach().contiguous().view(-1)
    nbytes = raw.numel() * raw.element_size()
    words = raw.view(torch.int32) if nbytes % 4 == 0 else raw.view(torch.uint8)
    x = words.to(torch.int64)
    w = torch.arange(x.numel(), device=x.device, dtype=torch.int64).remainder_(65521).add_(1)
    s1 = int(x.sum().item())
    s2 = int((x * w).sum().item())
    return f"{s1 & 0xFFFFFFFFFFFFFFFF:016x}{s2 & 0xFFFFFFFFFFFFFFFF:016x}"


def legacy_sums(flat: torch.Tensor) -> torch.Tensor:
    """The legacy checksum (two device syncs per call) in the shape app/weights/ now collects per bucket."""
    ck = legacy_checksum(flat)
    signed = [(int(ck[i : i + 16], 16) + 2**63) % 2**64 - 2**63 for i in (0, 16)]
    return torch.tensor([*signed, 0], dtype=torch.int64)


def legacy_wait(self: StatelessGroup, work: Any) -> None:
    work.wait(self.timeout)  # torch polls with 1 ms sleeps when given a timeout


@contextlib.contextmanager
def variant(name: str, dev: torch.device):
    saved = sync_walk._checksum_sums, StatelessGroup.wait
    zeros = torch.zeros(3, dtype=torch.int64, device=dev)
    try:
        if name == "nockpt":
            sync_walk._checksum_sums = lambda flat: zeros
        elif name == "legacy":
            sync_walk._checksum_sums = legacy_sums
            StatelessGroup.wait = legacy_wait  # type: ignore[method-assign]
        yield
    finally:
        sync_walk._checksum_sums, StatelessGroup.wait = saved  # type: ignore[method-assign]


def profile_table(prof: Any, rows: int = 14) -> str:
    """The top ops by CUDA time, then by the host's own time (what a host-bound end spends per bucket)."""
    tables = []
    for keys in (("device_time_total", "cuda_time_total"), ("self_cpu_time_total",)):
        for key in keys:
            try:
                tables.append(prof.key_averages().table(sort_by=key, row_limit=rows))
                break
            except Exception:
                continue
    return "\n".join(tables)


# ---------------------------------------------------------------- one process of the pair


def now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)  # the same clock in both processes


def sync_dev(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def worker(rank: int, port: int, args: dict[str, Any], out: Any) -> None:
    try:
        _worker(rank, port, args, out)
    except BaseException as e:
        import traceback

        out.put({"rank": rank, "error": f"{e}\n{traceback.format_exc()}"})
        raise


def _worker(rank: int, port: int, args: dict[str, Any], out: Any) -> None:
    cpu = args["cpu"]
    if cpu:
        dev = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    else:
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    group = StatelessGroup(
        "127.0.0.1", port, rank, 2, "gloo" if cpu else "nccl", 300.0, 0, dev, args["nccl_high_priority"]
    )
    for size in args["sizes"]:
        _bench_size(group, rank, dev, size, args, out)
        if dev.type == "cuda":  # the size's tensors went with its call
            torch.cuda.empty_cache()
    group.barrier()
    group.close()
    out.put({"rank": rank, "done": True})


@dataclass
class Rig:
    """One model size on one end of the bench: what every timing of that size uses."""

    group: StatelessGroup
    rank: int
    dev: torch.device
    size: str
    specs: list[tuple[str, tuple[int, ...], str]]
    state: dict[str, torch.Tensor]
    load: SlotLoader
    bucket_bytes: int
    args: dict[str, Any]
    out: Any

    def gather(self, names: list[str]) -> list[torch.Tensor]:
        return [self.state[n] for n in names]

    def put(self, variant: str, rec: dict[str, Any]) -> None:
        self.out.put({"rank": self.rank, "size": self.size, "variant": variant, **rec})


def _bench_size(group: StatelessGroup, rank: int, dev: torch.device, size: str, args: dict, out: Any) -> None:
    """One model size: every variant's pushes, a raw broadcast of the same bytes, the sender's pack profile
    and (`--trace`) one push under the profiler."""
    specs = qwen2_specs(size)
    if rank == 0:
        g = torch.Generator(device=dev).manual_seed(0)
        state = {n: torch.randn(s, generator=g, device=dev).to(torch.bfloat16) for n, s, _ in specs}
    else:
        state = {n: torch.empty(s, dtype=torch.bfloat16, device=dev) for n, s, _ in specs}
    # the receiver loads as a replica's worker does (app/vllm/fast_load.py): one batched copy per bucket,
    # queued on the device, so the receive never waits on the host for a bucket
    shapes = {n: tuple(s) for n, s, _ in specs}
    slots = plan_slots(shapes, shapes, {})
    if slots is None:
        raise RuntimeError(f"{size}: SlotLoader cannot place the stand-in's own tensors")
    bucket_bytes = int(args["bucket_mb"] * 2**20)
    rig = Rig(group, rank, dev, size, specs, state, SlotLoader(state, slots), bucket_bytes, args, out)
    for var in args["variants"]:
        with variant(var, dev):
            _time_pushes(rig, var)
    _time_raw(rig)
    if rank == 0:
        _profile_pack(rig)
    if size == args["trace"] and dev.type == "cuda":
        _trace_push(rig)
    group.barrier()


def _push(rig: Rig, plan: Any) -> Any:
    """One push of the whole model through Relay's bucket protocol: the sender's stats, or the receiver's
    (checksums, timing)."""
    if rig.rank == 0:
        return send_buckets(plan, rig.gather, rig.group, rig.dev)
    return receive_buckets(plan, rig.group, rig.load, rig.dev)


def _time_pushes(rig: Rig, var: str) -> None:
    """`warmup` + `reps` pushes, each timed on both ends."""
    warmup = rig.args["warmup"]
    for i in range(warmup + rig.args["reps"]):
        plan = plan_buckets(rig.specs, rig.bucket_bytes, version=i)
        rig.group.barrier()
        sync_dev(rig.dev)
        t0 = now()
        got = _push(rig, plan)
        sync_dev(rig.dev)
        if rig.rank == 0:
            rec = {
                "gather_s": got.gather_s,
                "pack_s": got.pack_s,
                "transfer_s": got.transfer_s,
                "checksums": got.checksums,
            }
        else:
            cks, timing = got
            rec = {"recv_transfer_s": timing["transfer_s"], "load_s": timing["load_s"], "checksums": cks}
        rec.update(t0=t0, t1=now(), rep=i, buckets=len(plan.buckets), nbytes=plan.nbytes)
        if i >= warmup:
            rig.put(var, rec)


def _time_raw(rig: Rig) -> None:
    """The same bytes as one flat tensor through one raw broadcast: the link's own figure."""
    numel = sum(torch.Size(s).numel() for _, s, _ in rig.specs)
    flat = torch.empty(numel, dtype=torch.bfloat16, device=rig.dev)
    if rig.rank == 0:
        flat.normal_()
    opts = torch.distributed.BroadcastOptions()
    warmup = rig.args["warmup"]
    for i in range(warmup + rig.args["reps"]):
        rig.group.barrier()
        sync_dev(rig.dev)
        t0 = now()
        rig.group.pg.broadcast([flat], opts).wait()
        sync_dev(rig.dev)
        if i >= warmup:
            rig.put("raw", {"t0": t0, "t1": now(), "nbytes": flat.numel() * 2})


def _profile_pack(rig: Rig) -> None:
    """Where the sender's pack time goes: the copies alone, the checksum alone (new and legacy)."""
    dev = rig.dev
    plan = plan_buckets(rig.specs, rig.bucket_bytes, version=0)
    prof = {"pack_only_s": 0.0, "checksum_s": 0.0, "legacy_checksum_s": 0.0}
    for _ in range(2):  # the first pass warms the allocator; the second is kept
        for k in prof:
            prof[k] = 0.0
        for b in plan.buckets:
            tensors = rig.gather([t.name for t in b.tensors])
            buf = torch.empty(b.numel, dtype=torch.bfloat16, device=dev)
            sync_dev(dev)
            t0 = now()
            pack_into(b, tensors, buf)
            sync_dev(dev)
            t1 = now()
            sync_walk._checksum_sums(buf)
            sync_dev(dev)
            t2 = now()
            legacy_checksum(buf)
            t3 = now()
            prof["pack_only_s"] += t1 - t0
            prof["checksum_s"] += t2 - t1
            prof["legacy_checksum_s"] += t3 - t2
    rig.put("profile", prof)


def _trace_push(rig: Rig) -> None:
    """One push under the profiler: where the time goes."""
    from torch.profiler import ProfilerActivity, profile

    plan = plan_buckets(rig.specs, rig.bucket_bytes, version=0)
    rig.group.barrier()
    sync_dev(rig.dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _push(rig, plan)
        sync_dev(rig.dev)
    rig.put("trace", {"table": profile_table(prof)})


# ---------------------------------------------------------------- driver


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(msgs: list[dict], args: dict[str, Any]) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for size in args["sizes"]:
        row: dict[str, Any] = {}
        by = {(m["rank"], m["variant"]): [] for m in msgs if m.get("size") == size}
        for m in msgs:
            if m.get("size") == size:
                by[(m["rank"], m["variant"])].append(m)
        raw_s = [
            r["t1"] - s["t0"] for s, r in zip(by.get((0, "raw"), []), by.get((1, "raw"), []), strict=True)
        ]
        row["nbytes"] = by[(0, "raw")][0]["nbytes"]
        row["raw_ms"] = 1e3 * median(raw_s)
        row["raw_GBps"] = row["nbytes"] / median(raw_s) / 1e9
        for var in args["variants"]:
            snd, rcv = by.get((0, var), []), by.get((1, var), [])
            push_s = [r["t1"] - s["t0"] for s, r in zip(snd, rcv, strict=True)]
            row[var] = {
                "push_ms": 1e3 * median(push_s),
                "push_GBps": row["nbytes"] / median(push_s) / 1e9,
                "ratio_to_raw": median(push_s) / median(raw_s),
                "buckets": snd[0]["buckets"],
                "sender_ms": {
                    k[:-2]: 1e3 * median([s[k] for s in snd]) for k in ("gather_s", "pack_s", "transfer_s")
                },
                "sender_wall_ms": 1e3 * median([s["t1"] - s["t0"] for s in snd]),
                "receiver_ms": {
                    k[:-2]: 1e3 * median([r[k] for r in rcv]) for k in ("recv_transfer_s", "load_s")
                },
                "verified": var == "nockpt"
                or all(s["checksums"] == r["checksums"] for s, r in zip(snd, rcv, strict=True)),
            }
        for r in (0, 1):
            for t in by.get((r, "trace"), []):
                row.setdefault("trace", {})[f"rank{r}"] = t["table"]
        prof = by.get((0, "profile"), [{}])[0]
        row["profile_ms"] = {k[:-2]: 1e3 * v for k, v in prof.items() if k.endswith("_s")}
        res[size] = row
    return res


def parse_args() -> dict[str, Any]:
    """The workers' settings from the command line (sizes checked)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU (default when CUDA has < 2 GPUs)")
    ap.add_argument("--sizes", default=None, help="comma list of " + ",".join(QWEN2_SHAPES))
    ap.add_argument("--bucket-mb", type=float, default=64.0, help="sync.broadcast.bucket_mb")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--variants", default="current,nockpt,legacy")
    ap.add_argument("--trace", default="", help="profile one push of this size (GPU) and print the top ops")
    ap.add_argument(
        "--nccl-high-priority", action="store_true", help="the weight group's NCCL stream at high priority"
    )
    ap.add_argument("--deadline-s", type=float, default=1800.0, help="the whole run's deadline")
    ns = ap.parse_args()
    cpu = ns.cpu or not torch.cuda.is_available() or torch.cuda.device_count() < 2
    sizes = (ns.sizes or ("tiny" if cpu else "0.5B,1.5B,3B,7B")).split(",")
    for s in sizes:
        if s not in QWEN2_SHAPES:
            ap.error(f"unknown size {s!r}; choose from {', '.join(QWEN2_SHAPES)}")
    return {
        "cpu": cpu,
        "sizes": sizes,
        "bucket_mb": ns.bucket_mb,
        "reps": ns.reps,
        "warmup": ns.warmup,
        "variants": ns.variants.split(","),
        "trace": ns.trace,
        "nccl_high_priority": ns.nccl_high_priority,
        "deadline_s": ns.deadline_s,
    }


def run_workers(args: dict[str, Any]) -> list[dict]:
    """The sender and the receiver in two spawned processes: their messages, once both are done. Fails
    naming the rank and its error, or what was still awaited at `deadline_s`."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, args, out)) for r in range(2)]
    deadline = time.monotonic() + args["deadline_s"]
    for p in procs:
        p.start()
    msgs, done, failure = [], 0, ""
    try:
        while done < 2 and not failure:
            if time.monotonic() > deadline:
                last = msgs[-1] if msgs else {}
                failure = (
                    f"{2 - done} of 2 workers still running after --deadline-s={args['deadline_s']:g} (the "
                    f"last result: size {last.get('size')}, variant {last.get('variant')})"
                )
                break
            try:
                m = out.get(timeout=5)
            except Exception:
                if any(p.exitcode not in (None, 0) for p in procs):
                    failure = "a worker exited with an error (see above)"
                continue
            if "error" in m:
                failure = f"rank {m['rank']} failed: {m['error']}"
            elif m.get("done"):
                done += 1
            else:
                msgs.append(m)
    finally:
        for p in procs:
            p.join(30 if not failure else 1)
            if p.is_alive():
                p.kill()
    if failure:
        raise SystemExit(f"sync_bandwidth: {failure}")
    return msgs


def print_table(res: dict[str, dict], variants: list[str]) -> None:
    for size, row in res.items():
        print(
            f"\n{size}: {row['nbytes'] / 1e9:.2f} GB; raw broadcast {row['raw_ms']:.2f} ms ({row['raw_GBps']:.0f} GB/s)"
        )
        for var in variants:
            v = row[var]
            print(
                f"  {var:8s} push {v['push_ms']:8.2f} ms  x{v['ratio_to_raw']:.2f} raw  {v['buckets']} buckets  "
                f"sender {v['sender_ms']}  receiver {v['receiver_ms']}  verified={v['verified']}"
            )
        print(f"  sender profile (ms): {row['profile_ms']}")
        for who, table in row.pop("trace", {}).items():
            print(f"  one {size} push under the profiler, {who}:\n{table}")


def main() -> None:
    args = parse_args()
    t_start = time.time()
    res = summarize(run_workers(args), args)
    print_table(res, args["variants"])
    cpu = args["cpu"]
    summary = {
        "bench": "sync_bandwidth",
        "device": "cpu" if cpu else torch.cuda.get_device_name(0),
        "backend": "gloo" if cpu else "nccl",
        "torch": torch.__version__,
        "bucket_mb": args["bucket_mb"],
        "nccl_high_priority": args["nccl_high_priority"],
        "reps": args["reps"],
        "warmup": args["warmup"],
        "wall_s": round(time.time() - t_start, 1),
        "ratios": {s: round(r["current"]["ratio_to_raw"], 3) for s, r in res.items() if "current" in r},
        "push_ms": {s: round(r["current"]["push_ms"], 3) for s, r in res.items() if "current" in r},
        "raw_ms": {s: round(r["raw_ms"], 3) for s, r in res.items()},
        "results": res,
    }
    if "3B" in res and "current" in res["3B"]:
        c = res["3B"]["current"]
        summary["goal_3B"] = {
            "push_ms": round(c["push_ms"], 2),
            "under_50ms": c["push_ms"] < 50,
            "within_2x_raw": c["ratio_to_raw"] <= 2,
        }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
