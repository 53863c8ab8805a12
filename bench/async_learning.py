"""Does fully asynchronous training learn as well as synchronous training for the same samples?

    python bench/async_learning.py [--steps 60] [--max-staleness 2] [--correction decoupled]

Trains the built-in task twice on one local Ray cluster: `sync`, then `fully_async` with
`max_staleness` (default 2) and partial rollouts, with the same number of optimizer steps, groups per step
and samples per group (so the same number of trained samples). Validation reward (greedy, held-out split)
is read back from MLflow by the version it measured, plotted against trained samples
(`runs/bench_async_learning/<time>/async_learning.png`), and the end points are printed in a final JSON line;
`within_tolerance` says whether fully_async's final reward is at least sync's minus `--tolerance` (0.03).
`--config gpu2` runs both on two GPUs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.config import load_config
from bench.loop_setup import fresh_out_dir, start_local_ray

log = logging.getLogger("bench.async_learning")


def curve(tracking_uri: str, run_id: str, samples_per_version: int) -> list[tuple[int, float]]:
    """(trained samples, val/reward) points, by the version each validation measured."""
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri)
    rewards = c.get_metric_history(run_id, "val/reward")
    versions = c.get_metric_history(run_id, "val/version")
    by_step: dict[tuple[int, int], float] = {}
    for r, v in zip(
        sorted(rewards, key=lambda m: (m.step, m.timestamp)),
        sorted(versions, key=lambda m: (m.step, m.timestamp)),
    ):
        by_step[(int(v.value), r.step)] = r.value
    return sorted((v * samples_per_version, x) for (v, _), x in by_step.items())


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--max-staleness", type=float, default=2.0)
    ap.add_argument("--correction", default="decoupled", choices=["none", "tis", "decoupled"])
    ap.add_argument("--partial", default="keep", choices=["keep", "resubmit", "off"])
    ap.add_argument("--val-every", type=int, default=5)
    ap.add_argument("--config", default=None, help="a preset under configs/ for both runs, e.g. gpu2")
    ap.add_argument("--tolerance", type=float, default=0.03, help="the largest final gap that passes")
    ap.add_argument("--cache-dir", default=".cache/relay")
    ap.add_argument("--out", default="runs/bench_async_learning")
    return ap.parse_args()


def run_both(
    args: argparse.Namespace, out: Path
) -> tuple[dict[str, list[tuple[int, float]]], dict[str, dict]]:
    """`sync`, then `fully_async`, on one local Ray cluster: each one's validation curve (trained samples,
    reward) and its end figures."""
    import ray

    from app import driver

    common = [
        f"train.steps={args.steps}",
        f"algorithm.val_every={args.val_every}",
        f"model.cache_dir={args.cache_dir}",
        f"run_dir={out}",
    ]
    runs = {
        "sync": ["algorithm.mode=sync"],
        "fully_async": [
            "algorithm.mode=fully_async",
            f"algorithm.max_staleness={args.max_staleness}",
            f"algorithm.correction={args.correction}",
            f"rollout.partial={args.partial}",
        ],
    }
    start_local_ray()
    curves: dict[str, list[tuple[int, float]]] = {}
    ends: dict[str, dict] = {}
    try:
        for mode, over in runs.items():
            cfg = load_config(
                args.config, [*common, *over, f"ray.name=learn-{mode}", f"tracking.run_name={mode}"]
            )
            per_version = cfg.train.batch_groups * cfg.rollout.n
            res = driver.run(cfg)
            curves[mode] = curve(res["tracking_uri"], res["run_id"], per_version)
            ends[mode] = {
                "steps": res["steps"],
                "trained_samples": res["steps"] * per_version,
                "val_reward_first": round(res["val_reward_first"], 4),
                "val_reward_last": round(res["val_reward_last"], 4),
                "wall_s": res["wall_s"],
            }
            log.info("%s: %s", mode, ends[mode])
    finally:
        ray.shutdown()
    return curves, ends


def plot_curves(curves: dict[str, list[tuple[int, float]]], max_staleness: float, out: Path) -> Path:
    """Validation reward against trained samples, one line per mode: the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, pts in curves.items():
        label = mode if mode == "sync" else f"{mode} (max_staleness={max_staleness:g})"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xlabel("trained samples")
    ax.set_ylabel("validation reward (greedy)")
    ax.set_title("built-in task: sync vs fully_async")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    plot = out / "async_learning.png"
    fig.savefig(plot, dpi=120)
    return plot


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out = fresh_out_dir(args.out)
    curves, ends = run_both(args, out)
    plot = plot_curves(curves, args.max_staleness, out)
    gap = ends["sync"]["val_reward_last"] - ends["fully_async"]["val_reward_last"]
    summary = {
        "bench": "async_learning",
        "max_staleness": args.max_staleness,
        "correction": args.correction,
        "partial": args.partial,
        "runs": ends,
        "curves": {m: [[s, round(r, 4)] for s, r in pts] for m, pts in curves.items()},
        "config": args.config,
        "final_gap": round(gap, 4),
        "tolerance": args.tolerance,
        "within_tolerance": gap <= args.tolerance,
        "plot": str(plot),
    }
    sys.stdout.write(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()
