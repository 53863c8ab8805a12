"""Trained tokens per second of `sync`, `one_step_off` and `fully_async` on the same resources, one run.

    python bench/async_speedup.py [--prompts 160] [--batch-groups 8] [--n 4] [--max-tokens 96]
                                  [--lengths pareto:1.2:4] [--max-staleness 1] [--partial keep]
    python bench/async_speedup.py --gpus 2 --shape 1.5B --max-tokens 2048 --lengths pareto:1.2:128  # 2 GPUs
    python bench/async_speedup.py --gpus 2 --shape 1.5B rollout.cuda_graphs=true  # config overrides, every mode

The built-in task with a long-tailed response-length distribution: every prompt group gets
min(max_tokens, MIN x Pareto(ALPHA)) tokens (EOS ignored, so lengths are exact and the same prompt has the
same length in every mode). Each mode trains the same prompts once (`data.epochs=1`) on one local Ray
cluster started here (same replicas, trainer workers and CPUs for each), so the trained tokens are the same
and the ratio is one of loop times: from the first step to the last push, validation excluded. Prints a
final JSON line with tokens/s per mode and three ratios to `sync`: over the whole loop (`ratio_to_sync`), by
the median step (`step_ratio_to_sync`), and by the trained tokens/s of the steady state
(`steady_ratio_to_sync`: the steps between the first and the last; a short run's loop is mostly its first step,
the trainer's compile and the first generation that nothing overlaps, and an overlapped mode's last step has no
next batch to wait for).

Where each mode needs its own call (a GPU engine's start and a realistic shape fill a 10-minute call), save each
run's output and pass it to the next with `--with`; the last run's line then holds every mode and the ratios:

    python bench/async_speedup.py --gpus 2 --shape 1.5B --modes sync > sync.out
    python bench/async_speedup.py --gpus 2 --shape 1.5B --modes one_step_off --with sync.out
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.config import load_config
from bench.loop_setup import fresh_out_dir, start_local_ray

log = logging.getLogger("bench.async_speedup")


def write_prompts(cache_dir: str, path: Path, n: int) -> int:
    from app.driver import resolve_inputs

    rows = resolve_inputs(load_config(None, [f"model.cache_dir={cache_dir}"])).train_rows[:n]
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({"id": r.uid, "prompt": r.prompt, "answer": r.answer, "data_source": "arith"}))
            f.write("\n")
    return len(rows)


MEDIANS = (
    ("sync/time_s", "push_ms"),
    ("sync/pause_s", "pause_ms"),
    # a step's parts: what bounds the overlap one_step_off can win ((gen + train) / max(gen, train))
    ("timing/generate_s", "generate_ms"),
    ("timing/train_s", "train_ms"),
    ("timing/wait_rollout_s", "wait_rollout_ms"),
    ("timing/step_s", "step_ms"),
)
"""The run's metrics whose medians the bench reports, and their names in its results."""


def run_series(tracking_uri: str, run_id: str) -> dict[str, list[float]]:
    """Each metric of `MEDIANS` of the run, its values in step order (an empty list where none was logged):
    read once, for `push_medians` and `per_step`."""
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri)
    return {
        key: [m.value for m in sorted(c.get_metric_history(run_id, key), key=lambda m: m.step)]
        for key, _ in MEDIANS
    }


def push_medians(series: dict[str, list[float]]) -> dict[str, float]:
    """Median per push, in ms, of the whole push as the trainer sees it (`sync/time_s`) and of the
    generation pause a client sees (`sync/pause_s`: the replica held its generations, pause to resume); and
    median per step of the batch's generation, the training, the trainer's wait for rollouts and the step.
    `series`: `run_series`."""
    import statistics

    return {
        name: round(1000 * statistics.median(series[key]), 2) if series[key] else float("nan")
        for key, name in MEDIANS
    }


def per_step(
    series: dict[str, list[float]], points: list[tuple[int, float, float]]
) -> dict[str, list[float]]:
    """Each step's seconds (generation, training, wait for rollouts, the whole step) and each step's end after
    the first step's (`end_s`, from `points`: `steady_points`), in step order: what a median hides, e.g.
    whether the steady state's window gained from a warm-up that overlapped generation. `series`:
    `run_series`."""
    out = {
        f"{key}_s": [round(v, 3) for v in series[f"timing/{key}_s"]]
        for key in ("generate", "train", "wait_rollout", "step")
    }
    ends = sorted(points)
    out["end_s"] = [round(p[1] - ends[0][1], 3) for p in ends] if ends else []
    return out


def steady_tokens_per_s(points: list[tuple[int, float, float]]) -> float:
    """Trained tokens per second between the first and the last step: `points` are (step, logged at in
    seconds, the step's trained tokens), one per step, logged as each step ends. The first step carries the
    run's warm-up (the trainer's first compile, `one_step_off`'s first generation, which nothing overlaps);
    the last is short in the overlapped modes (nothing is left to generate: `one_step_off`'s last step is its
    training alone), which would flatter them. So this is the tokens of steps 2..k-1 over the time from the
    end of step 1 to the end of step k-1 (NaN with fewer than three steps)."""
    pts = sorted(points)[:-1]
    if len(pts) < 2 or pts[-1][1] <= pts[0][1]:
        return float("nan")
    return sum(p[2] for p in pts[1:]) / (pts[-1][1] - pts[0][1])


def steady_points(tracking_uri: str, run_id: str) -> list[tuple[int, float, float]]:
    """(step, logged at, trained tokens) of each step of the run, from its `train/tokens` metric."""
    from mlflow.tracking import MlflowClient

    hist = MlflowClient(tracking_uri).get_metric_history(run_id, "train/tokens")
    return [(m.step, m.timestamp / 1000.0, m.value) for m in hist]


def step_ratios(results: dict[str, dict]) -> dict[str, float]:
    """Each mode's speed against sync's by the median step: sync's median step over the mode's (every mode
    trains batches of the same size, so steps per second compare as trained tokens per second do)."""
    base = results.get("sync", {}).get("step_ms")
    if not base or base != base:  # none, or NaN (no step recorded)
        return {}
    return {m: round(base / r["step_ms"], 3) for m, r in results.items() if r.get("step_ms")}


def ratios(results: dict[str, dict], key: str) -> dict[str, float]:
    """Each mode's `key` (a rate: higher is faster) over sync's; {} without a finite sync figure."""
    base = results.get("sync", {}).get(key)
    if not base or base != base:
        return {}
    return {m: round(r[key] / base, 3) for m, r in results.items() if r.get(key) == r.get(key)}


SAME = ("prompts", "batch_groups", "n", "max_tokens", "lengths", "gpu", "gpus", "shape", "overrides")
"""The settings two runs must share for their modes to compare (`--with`)."""


def check_comparable(summary: dict, earlier: list[dict]) -> None:
    """Raises ValueError naming the first setting an earlier run's final JSON line does not share with this
    run's `summary` (its settings)."""
    for other in earlier:
        for key in SAME:
            if other.get(key) != summary.get(key):
                raise ValueError(
                    f"an earlier run had {key}={other.get(key)!r}, this one {summary.get(key)!r}: only runs "
                    f"of the same {', '.join(SAME)} compare"
                )


def merge_earlier(modes: dict[str, dict], earlier: list[dict]) -> dict[str, dict]:
    """This run's `modes` plus those of `earlier` runs (this run's win where a mode is in both)."""
    merged: dict[str, dict] = {}
    for other in earlier:
        merged.update(other.get("modes", {}))
    return {**merged, **modes}


def with_ratios(summary: dict) -> dict:
    """`summary` with its three ratios to `sync` (none without a sync run among its modes)."""
    results = summary["modes"]
    return {
        **summary,
        "ratio_to_sync": ratios(results, "tokens_per_s"),
        # the same by the median step (sync's median step over each mode's): the steady state, which the
        # whole loop's ratio reaches only over many steps (a short run is mostly its first steps)
        "step_ratio_to_sync": step_ratios(results),
        # trained tokens/s between the first and the last step (warm-up and wind-down excluded), against sync's
        "steady_ratio_to_sync": ratios(results, "steady_tokens_per_s"),
    }


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=160)
    ap.add_argument("--batch-groups", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--lengths", default="pareto:1.2:4", help="fixed | pareto:ALPHA:MIN")
    ap.add_argument("--max-staleness", type=float, default=1.0)
    ap.add_argument("--partial", default="keep", choices=["keep", "resubmit", "off"])
    ap.add_argument("--max-inflight", type=int, default=0, help="fully_async groups in flight (0: 2 batches)")
    ap.add_argument("--modes", default="sync,one_step_off,fully_async")
    ap.add_argument("--gpu", action="store_true", help="configs/gpu1.yaml: replica and trainer share one GPU")
    ap.add_argument(
        "--gpus",
        type=int,
        default=0,
        help="2: configs/gpu2.yaml (the replica on one GPU, the trainer on the other)",
    )
    ap.add_argument(
        "--shape", default="embedded", help="embedded, or a Qwen2.5 shape (bench/qwen_shapes.py): 1.5B"
    )
    ap.add_argument("--models", default=os.path.join(tempfile.gettempdir(), "relay-models"))
    ap.add_argument("--cache-dir", default=".cache/relay")
    ap.add_argument("--out", default="runs/bench_async_speedup")
    ap.add_argument(
        "--with",
        dest="earlier",
        nargs="*",
        default=[],
        metavar="FILE",
        help="earlier runs' output (their final JSON line is read): their modes join this run's ratios, e.g. "
        "a `--modes sync` run when each mode needs its own call",
    )
    ap.add_argument(
        "overrides", nargs="*", help="config overrides for every mode, e.g. rollout.cuda_graphs=true"
    )
    return ap.parse_args()


def last_json_line(path: str) -> dict:
    """The final JSON line of an earlier run's output (a log may precede it)."""
    lines = [ln for ln in Path(path).read_text().splitlines() if ln.startswith("{")]
    if not lines:
        raise ValueError(f"{path}: no JSON line; pass a file holding async_speedup.py's output")
    return json.loads(lines[-1])


def common_overrides(args: argparse.Namespace, out: Path) -> tuple[list[str], int]:
    """The settings every mode runs with (the same prompts, once each, the same lengths and resources), and
    the number of prompts written (the data may hold fewer than `--prompts`)."""
    data = Path(tempfile.mkdtemp(prefix="relay-bench-")) / "train.jsonl"
    n_prompts = write_prompts(args.cache_dir, data, args.prompts)
    common = [
        f"data.train={data}",
        "data.epochs=1",
        "data.val_size=8",
        "algorithm.val_every=100000",  # validation only before the first and after the last step
        f"train.steps={10 * n_prompts}",  # the data ends the run
        f"train.batch_groups={args.batch_groups}",
        f"rollout.n={args.n}",
        f"rollout.max_tokens={args.max_tokens}",
        f"rollout.max_model_len={args.max_tokens + 64}",
        "rollout.ignore_eos=true",
        f"rollout.lengths={args.lengths}",
        f"model.cache_dir={args.cache_dir}",
        f"run_dir={out}",
    ]
    if args.shape != "embedded":  # random weights, full vocabulary: throughput, not learning
        from bench.qwen_shapes import build_model_dir

        common += [f"model.path={build_model_dir(args.shape, args.models)}", "model.allow_toy_settings=true"]
    return common, n_prompts


def run_modes(args: argparse.Namespace, common: list[str]) -> dict[str, dict]:
    """Each mode of `--modes` in turn on one local Ray cluster: its trained tokens/s and step medians."""
    import ray

    from app import driver

    extra = {
        "fully_async": [
            f"algorithm.max_staleness={args.max_staleness}",
            f"rollout.partial={args.partial}",
            f"rollout.max_inflight={args.max_inflight or 2 * args.batch_groups}",
            "algorithm.correction=decoupled",
        ]
    }
    start_local_ray()
    results: dict[str, dict] = {}
    try:
        for mode in args.modes.split(","):
            cfg = load_config(
                "gpu2" if args.gpus == 2 else ("gpu1" if args.gpu else None),
                [
                    *common,
                    f"algorithm.mode={mode}",
                    f"ray.name=bench-{mode}",
                    f"tracking.run_name={mode}",
                    *extra.get(mode, []),
                    *args.overrides,  # last: they win over the bench's own settings
                ],
            )
            res = driver.run(cfg)
            points = steady_points(res["tracking_uri"], res["run_id"])
            series = run_series(res["tracking_uri"], res["run_id"])
            results[mode] = {
                "steps": res["steps"],
                "trained_tokens": res["trained_tokens"],
                "loop_s": round(res["loop_s"], 2),
                "tokens_per_s": round(res["trained_tokens"] / res["loop_s"], 1),
                "steady_tokens_per_s": round(steady_tokens_per_s(points), 1),
                **push_medians(series),
                "per_step": per_step(series, points),
            }
            log.info("%s: %s", mode, {k: v for k, v in results[mode].items() if k != "per_step"})
    finally:
        ray.shutdown()
    return results


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    earlier = [last_json_line(p) for p in args.earlier]
    out = fresh_out_dir(args.out)
    common, n_prompts = common_overrides(args, out)
    summary = {
        "bench": "async_speedup",
        "prompts": n_prompts,
        "batch_groups": args.batch_groups,
        "n": args.n,
        "max_tokens": args.max_tokens,
        "lengths": args.lengths,
        "max_staleness": args.max_staleness,
        "partial": args.partial,
        "gpu": args.gpu,
        "gpus": args.gpus,
        "shape": args.shape,
        "overrides": args.overrides,
    }
    check_comparable(summary, earlier)  # before the runs: runs that cannot compare fail at once
    summary["modes"] = merge_earlier(run_modes(args, common), earlier)
    sys.stdout.write(json.dumps(with_ratios(summary)) + "\n")


if __name__ == "__main__":
    main()
