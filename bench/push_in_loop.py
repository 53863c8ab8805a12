"""The weight push inside the loop, on two GPUs: Qwen2.5-shaped models pushed by the trainer's `TrainerSync`
(a Ray Train FSDP2 worker on one GPU) through the run's `WeightHub` into a Serve vLLM replica on the other
GPU, over NCCL: the whole of `sync/time_s` as the trainer sees it, and each phase.

    python bench/push_in_loop.py --shapes embedded,0.5B,1.5B,3B,7B --pushes 8 [--loaded 5]
    python bench/push_in_loop.py --preset colocated --shapes 1.5B     # a rank and a replica on every GPU, CUDA IPC

Each shape: a model folder with random bf16 weights and a synthetic full-vocabulary tokenizer
(bench/qwen_shapes.py; `embedded` is the built-in tiny model), the run's roles started as `app.driver` starts
them (`configs/gpu2.yaml`), then a train worker pushes `--pushes` + 1 times
(the first, which forms the weight group, is reported apart). The replica's acknowledged checksums equal the
trainer's on every push (`sync.verify`). Prints a JSON line per shape and a final summary line with the
median push and its phases; `--loaded K` adds K pushes with generations in flight and reports the
generation pause a client sees (the replica's pause-to-resume, `held_s`). Compare with `bench/sync_bandwidth.py`'s raw broadcast of the same bytes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

log = logging.getLogger("bench.push_in_loop")


def push_loop(config: dict[str, Any]) -> None:
    """Train worker: push `pushes` + 1 versions back to back; write each push's record to `out`."""
    import ray
    import torch
    from omegaconf import OmegaConf

    from app.names import NAMESPACE, hub_name
    from app.sync import TrainerSync
    from app.trainer.learner import Learner

    cfg = OmegaConf.create(config["cfg"])
    dev = torch.device("cuda", torch.cuda.current_device())
    learner = Learner(cfg, config["model_path"], dev)
    sync = TrainerSync(cfg, learner, ray.get_actor(hub_name(cfg.ray.name), namespace=NAMESPACE), dev)
    pushes = int(config["pushes"])
    records = [settled(sync, sync.push(v)).record() for v in range(pushes + 1)]
    loaded = [push_under_load(sync, cfg, v) for v in range(pushes + 1, pushes + 1 + int(config["loaded"]))]
    if learner.rank == 0:
        rep = {"transport": sync.transport_name, "pushes": records, "loaded": loaded}
        Path(config["out"]).write_text(json.dumps(rep))


def settled(sync: Any, stats: Any) -> Any:
    """The push's stats with its replicas' own phases, which follow the workers' acknowledgements (its time
    is the push's as the trainer saw it)."""
    sync.settle(30.0)  # rank 0's; a no-op elsewhere
    return stats


def push_under_load(sync: Any, cfg: Any, version: int) -> dict[str, Any]:
    """A push while generations are in flight (the preset's partial mode, `keep` with the KV cache kept in
    configs/gpu2.yaml): the replica's `held_s` (pause to resume) is the generation pause a client sees. The
    samples' per-token versions show the push landed mid-generation."""
    import time

    from ray import serve

    from app.names import DEPLOYMENT_NAME, app_name
    from app.records import GenerateRequest

    handle = serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=app_name(cfg.ray.name))
    req = GenerateRequest(prompt_ids=[5, 6, 7, 8], max_tokens=256, n=4, ignore_eos=True)
    calls = [handle.generate.remote(req) for _ in range(8)]
    deadline = time.monotonic() + 60
    while handle.info.remote().result(timeout_s=30)["ongoing"] == 0:
        if time.monotonic() > deadline:
            raise TimeoutError("no generation was in flight within 60s")
        time.sleep(0.005)
    time.sleep(0.2)  # tokens flowing, not just admitted
    rec = settled(sync, sync.push(version)).record()
    versions = [s.versions for c in calls for s in c.result(timeout_s=300).samples]
    rec["spanning"] = sum(1 for vs in versions if len(set(vs)) > 1)
    rec["samples"] = len(versions)
    return rec


def run_shape(
    shape: str,
    pushes: int,
    loaded: int,
    bucket_mb: float,
    models: str,
    out_dir: Path,
    preset: str = "gpu2",
    overrides: tuple[str, ...] = (),
) -> dict[str, Any]:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from app.config import load_config, to_container
    from app.driver import RolloutStartWatch, resolve_inputs, start_roles, teardown
    from app.names import app_name
    from bench.qwen_shapes import build_model_dir

    path = "builtin:tiny" if shape == "embedded" else build_model_dir(shape, models)
    name = f"push-{shape.replace('.', '')}".lower()
    cfg = load_config(
        preset,
        [
            f"model.path={path}",
            "model.allow_toy_settings=true",  # a model shape on the toy task
            f"model.cache_dir={models}",
            f"ray.name={name}",
            f"sync.broadcast.bucket_mb={bucket_mb}",
            "rollout.max_model_len=512",
            *overrides,
        ],
    )
    inputs = resolve_inputs(cfg)
    out = out_dir / f"{name}.json"
    try:
        cfg, _hub, _control, _rollouter = start_roles(cfg, inputs, RolloutStartWatch(app_name(name)))
        TorchTrainer(
            push_loop,
            train_loop_config={
                "cfg": to_container(cfg),
                "model_path": inputs.model_path,
                "pushes": pushes,
                "loaded": loaded,
                "out": str(out),
            },
            scaling_config=ScalingConfig(
                num_workers=cfg.train.workers,
                use_gpu=True,
                resources_per_worker={"CPU": 1, "GPU": cfg.train.worker_gpus},
            ),
            run_config=RunConfig(name=name, storage_path=str(out_dir / "train")),
        ).fit()
    finally:
        teardown(cfg, started=False)
    rep = json.loads(out.read_text())
    timed = rep["pushes"][1:]
    med = lambda xs: statistics.median(xs) if xs else 0.0  # noqa: E731
    phases = {k: round(1000 * med([p["phases"].get(k, 0.0) for p in timed]), 2) for k in timed[0]["phases"]}
    return {
        "shape": shape,
        "preset": preset,
        "transport": rep["transport"],
        "trainer_ranks": cfg.train.workers,
        "replicas": len(timed[0]["replicas"]),
        "nbytes": timed[0]["nbytes"],
        "buckets": timed[0]["buckets"],
        "first_push_ms": round(1000 * rep["pushes"][0]["wall_s"], 2),
        "push_ms": [round(1000 * p["wall_s"], 2) for p in timed],
        "median_push_ms": round(1000 * med([p["wall_s"] for p in timed]), 2),
        "median_phases_ms": phases,
        "retries": sum(len(p["failures"]) for p in rep["pushes"] + rep["loaded"]),
        **loaded_summary(rep["loaded"]),
    }


def loaded_summary(loaded: list[dict[str, Any]]) -> dict[str, Any]:
    """The pushes made with generations in flight: each one's pause (the replica's held_s), in ms."""
    if not loaded:
        return {}
    held = [1000 * p["phases"].get("replica_held_s", 0.0) for p in loaded]
    return {
        "loaded_push_ms": [round(1000 * p["wall_s"], 2) for p in loaded],
        "loaded_pause_ms": [round(h, 2) for h in held],
        "median_loaded_pause_ms": round(statistics.median(held), 2),
        "loaded_spanning_samples": [f"{p['spanning']}/{p['samples']}" for p in loaded],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="embedded,0.5B,1.5B,3B,7B")
    ap.add_argument("--pushes", type=int, default=8, help="timed pushes per shape (after the first)")
    ap.add_argument(
        "--loaded", type=int, default=0, help="then this many pushes with generations in flight (keep mode)"
    )
    ap.add_argument("--bucket-mb", type=float, default=256.0, help="sync.broadcast.bucket_mb (NCCL)")
    ap.add_argument(
        "--preset", default="gpu2", help="gpu2 (disaggregated, NCCL) or colocated (every GPU, CUDA IPC)"
    )
    ap.add_argument("--models", default=os.path.join(tempfile.gettempdir(), "relay-models"))
    ap.add_argument(
        "overrides",
        nargs="*",
        help="config overrides, e.g. rollout.tensor_parallel_size=2 (with --preset colocated)",
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import ray

    out_dir = Path(tempfile.mkdtemp(prefix="relay-push-in-loop-"))
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT)), "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "1"}
    ray.init(address="local", num_cpus=16, include_dashboard=False, runtime_env={"env_vars": env})
    results = []
    try:
        for shape in args.shapes.split(","):
            res = run_shape(
                shape,
                args.pushes,
                args.loaded,
                args.bucket_mb,
                args.models,
                out_dir,
                args.preset,
                tuple(args.overrides),
            )
            sys.stdout.write(json.dumps(res) + "\n")
            sys.stdout.flush()
            results.append(res)
    finally:
        ray.shutdown()
    summary = {r["shape"]: {"median_push_ms": r["median_push_ms"], "nbytes": r["nbytes"]} for r in results}
    head = {"bench": "push_in_loop", "preset": args.preset, "overrides": args.overrides}
    sys.stdout.write(json.dumps({**head, "bucket_mb": args.bucket_mb, "shapes": summary}) + "\n")


if __name__ == "__main__":
    main()
