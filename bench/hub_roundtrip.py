"""The push's control plane alone, no bytes: the trainer announces a plan to the real `WeightHub` actor, a
replica's weight loop wakes with it, hands the plan on as the vLLM workers get it (JSON), and acknowledges;
the trainer waits for the acknowledgement. Ray actors on this machine's CPUs, no GPU, no vLLM.

    python bench/hub_roundtrip.py [--shapes tiny,1.5B,7B] [--pushes 40]

Also measured, the way pushes acknowledge now (app/weights/ack_board.py): the stand-in replica posts its
acknowledgement into a TCPStore hosted by the trainer (as the weight group's store is) with `AckPoster` before it
acknowledges to the hub, and the trainer waits with `collect`: announce-to-acknowledged through the group's store,
against the hub's two Ray hops in the same pushes.

The replica here is a stand-in (the true boundary is vLLM, which `bench/push_in_loop.py` measures); the hub, the
records and their serialisation are the run's. The plan is a Qwen2.5 shape's (`bench/qwen_shapes.py`) in the
default 256 MiB buckets: its size on the wire is what this measures. Prints a JSON line per shape: the median
announce (trainer -> hub -> trainer), announce-to-acknowledged through the hub, and announce-to-acknowledged
through the store, in ms.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

log = logging.getLogger("bench.hub_roundtrip")


def qwen_specs(shape: str) -> list[tuple[str, tuple[int, ...], str]]:
    """The pushed tensors of a Qwen2.5 shape (HF names, bf16), in the trainer's order: the parameters of
    `bench/qwen_shapes.py`'s config, built on the meta device (no memory, no weights)."""
    import torch
    from transformers import Qwen2ForCausalLM

    from bench.qwen_shapes import qwen2_config

    with torch.device("meta"):
        model = Qwen2ForCausalLM(qwen2_config(shape))
    return [(n, tuple(p.shape), "bfloat16") for n, p in model.named_parameters()]


def make_replica_class() -> type:
    import ray

    from app.weights.ack_board import AckPoster
    from app.weights.records import Ack, Join, Push, plan_from_json, plan_to_json

    @ray.remote(num_cpus=0)
    class StandInReplica:
        """The replica's weight loop without an engine: long-poll, join, take each push's plan as the workers
        do (to JSON and back), acknowledge with a push's worth of checksums and phases."""

        def __init__(self, hub: object, rid: str, store_port: int) -> None:
            self.hub, self.rid, self.port = hub, rid, store_port
            self.poster: AckPoster | None = None

        async def run(self, pushes: int) -> None:
            await self.hub.register.remote(self.rid, 1)
            epoch, version, seen = -1, -1, 0
            while seen < pushes:
                instr = await self.hub.next_instruction.remote(self.rid, epoch, version, 5.0)
                if isinstance(instr, Join):
                    epoch = instr.group.epoch
                    self.poster = AckPoster("127.0.0.1", self.port, epoch, 30.0)
                    await self.hub.ack.remote(self.rid, "join", epoch, Ack(ok=True))
                elif isinstance(instr, Push):
                    plan = plan_from_json(plan_to_json(instr.plan))
                    version, seen = plan.version, seen + 1
                    ack = Ack(ok=True, checksums=["0" * 32] * len(plan.buckets), detail={"load_s": 0.0})
                    self.poster.post(version, self.rid, ack)  # type: ignore[union-attr]
                    await self.hub.ack.remote(self.rid, "push", version, ack)

    return StandInReplica


def measure(shape: str, pushes: int) -> dict:
    from datetime import timedelta

    import ray
    import torch.distributed as dist

    from app.weights.ack_board import collect
    from app.weights.buckets import plan_buckets
    from app.weights.group import free_port
    from app.weights.hub import WeightHub

    specs = qwen_specs(shape)
    port = free_port()
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False
    )
    hub = ray.remote(WeightHub).remote()
    done = make_replica_class().remote(hub, "r0", port).run.remote(pushes)
    deadline = time.monotonic() + 60
    while ray.get(hub.alive_count.remote()) < 1:
        if time.monotonic() > deadline:
            raise TimeoutError("the stand-in replica did not register within 60 s")
        time.sleep(0.05)
    group = ray.get(hub.open_epoch.remote("127.0.0.1", 1, "gloo", 10.0))
    ray.get(hub.wait_acks.remote("join", group.epoch, 10.0))
    announce, total, by_store = [], [], []
    for v in range(pushes):
        plan = plan_buckets(specs, 256 << 20, v)  # a fresh plan each push, as a trainer without a cache
        t0 = time.perf_counter()
        assert ray.get(hub.announce.remote(plan, group.epoch), timeout=30)
        t1 = time.perf_counter()
        pending = hub.wait_acks.remote("push", v, 10.0)  # asked at once, as the trainer does before its walk
        if collect(store, group.epoch, v, ["r0"], time.monotonic() + 30, lambda: False) is None:
            raise RuntimeError(f"push {v}: no acknowledgement in the store within 30 s")
        ts = time.perf_counter()
        acks = ray.get(pending, timeout=30)
        t2 = time.perf_counter()
        if not acks.complete:
            raise RuntimeError(f"push {v} not acknowledged: {acks}")
        announce.append(1000 * (t1 - t0))
        total.append(1000 * (t2 - t0))
        by_store.append(1000 * (ts - t0))
    ray.get(done, timeout=30)
    ray.kill(hub)
    warm = slice(min(5, pushes - 1), None)  # the first pushes warm the actors and the layout caches
    return {
        "shape": shape,
        "tensors": len(specs),
        "buckets": len(plan.buckets),
        "median_announce_ms": round(statistics.median(announce[warm]), 2),
        "median_roundtrip_ms": round(statistics.median(total[warm]), 2),
        "min_roundtrip_ms": round(min(total[warm]), 2),
        "median_roundtrip_by_store_ms": round(statistics.median(by_store[warm]), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="tiny,1.5B,7B")
    ap.add_argument("--pushes", type=int, default=40)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        for shape in args.shapes.split(","):
            sys.stdout.write(json.dumps({"bench": "hub_roundtrip", **measure(shape, args.pushes)}) + "\n")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
