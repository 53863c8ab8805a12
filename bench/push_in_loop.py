"""The weight push inside the loop, on two GPUs: Qwen2.5-shaped models pushed by the trainer's `TrainerSync`
(a Ray Train FSDP2 worker on one GPU) through the run's `WeightHub` into a Serve vLLM replica on the other
GPU, over NCCL: the whole of `sync/time_s` as the trainer sees it, and each phase.

    python bench/push_in_loop.py --shapes embedded,0.5B,1.5B,3B,7B --pushes 8

Each shape: a model folder with random bf16 weights and a synthetic full-vocabulary tokenizer
(bench/qwen_shapes.py; `embedded` is the built-in tiny model), the run's roles started as `app.driver` starts
them (`resources.rollout_gpus=1 resources.train_gpus=1`), then a train worker pushes `--pushes` + 1 times
(the first, which forms the weight group, is reported apart). The replica's acknowledged checksums equal the
trainer's on every push (`sync.verify`). Prints a JSON line per shape and a final summary line with the
median push and its phases; compare with `bench/sync_bandwidth.py`'s raw broadcast of the same bytes.
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

    from app.serve_rollout import NAMESPACE, hub_name
    from app.sync import TrainerSync
    from app.train_loop import Learner

    cfg = OmegaConf.create(config["cfg"])
    dev = torch.device("cuda", torch.cuda.current_device())
    learner = Learner(cfg, config["model_path"], dev)
    sync = TrainerSync(cfg, learner, ray.get_actor(hub_name(cfg.ray.name), namespace=NAMESPACE), dev)
    records = [sync.push(v).record() for v in range(int(config["pushes"]) + 1)]
    if learner.rank == 0:
        Path(config["out"]).write_text(json.dumps({"transport": sync.transport_name, "pushes": records}))


def run_shape(shape: str, pushes: int, bucket_mb: float, models: str, out_dir: Path) -> dict[str, Any]:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from app.config import load_config, to_container
    from app.driver import RolloutStartWatch, _start_roles, resolve_inputs, teardown
    from app.serve_rollout import app_name
    from bench.qwen_shapes import build_model_dir

    path = "builtin:tiny" if shape == "embedded" else build_model_dir(shape, models)
    name = f"push-{shape.replace('.', '')}".lower()
    cfg = load_config(
        None,
        [
            f"model.path={path}",
            f"model.cache_dir={models}",
            "model.dtype=bfloat16",
            "resources.rollout_gpus=1",
            "resources.train_gpus=1",
            f"ray.name={name}",
            f"sync.bucket_mb={bucket_mb}",
            "rollout.max_model_len=512",
        ],
    )
    inputs = resolve_inputs(cfg)
    out = out_dir / f"{name}.json"
    try:
        cfg, _hub, _control, _rollouter = _start_roles(cfg, inputs, RolloutStartWatch(app_name(name)))
        TorchTrainer(
            push_loop,
            train_loop_config={
                "cfg": to_container(cfg),
                "model_path": inputs.model_path,
                "pushes": pushes,
                "out": str(out),
            },
            scaling_config=ScalingConfig(
                num_workers=1, use_gpu=True, resources_per_worker={"CPU": 1, "GPU": cfg.train.worker_gpus}
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
        "transport": rep["transport"],
        "nbytes": timed[0]["nbytes"],
        "buckets": timed[0]["buckets"],
        "first_push_ms": round(1000 * rep["pushes"][0]["wall_s"], 2),
        "push_ms": [round(1000 * p["wall_s"], 2) for p in timed],
        "median_push_ms": round(1000 * med([p["wall_s"] for p in timed]), 2),
        "median_phases_ms": phases,
        "retries": sum(len(p["failures"]) for p in rep["pushes"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="embedded,0.5B,1.5B,3B,7B")
    ap.add_argument("--pushes", type=int, default=8, help="timed pushes per shape (after the first)")
    ap.add_argument("--bucket-mb", type=float, default=256.0, help="sync.bucket_mb (NCCL)")
    ap.add_argument("--models", default=os.path.join(tempfile.gettempdir(), "relay-models"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import ray

    out_dir = Path(tempfile.mkdtemp(prefix="relay-push-in-loop-"))
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT)), "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "1"}
    ray.init(address="local", num_cpus=16, include_dashboard=False, runtime_env={"env_vars": env})
    results = []
    try:
        for shape in args.shapes.split(","):
            res = run_shape(shape, args.pushes, args.bucket_mb, args.models, out_dir)
            sys.stdout.write(json.dumps(res) + "\n")
            sys.stdout.flush()
            results.append(res)
    finally:
        ray.shutdown()
    summary = {r["shape"]: {"median_push_ms": r["median_push_ms"], "nbytes": r["nbytes"]} for r in results}
    sys.stdout.write(
        json.dumps({"bench": "push_in_loop", "bucket_mb": args.bucket_mb, "shapes": summary}) + "\n"
    )


if __name__ == "__main__":
    main()
