"""Step time with rewards overlapped with generation vs computed after it, one run.

    python bench/reward_overlap.py [--steps 12] [--rewards delay,sandbox] [--gpu]
    python bench/reward_overlap.py --gpu --rewards sandbox --context 2048 --max-tokens 1536 \
        --batch-groups 64 --n 2 --lengths pareto:0.7:16 --workers 1 --max-concurrency 1 --match-scoring 0.95

Two costly rewards on the built-in task (sync mode, long-tailed response lengths so trajectories finish at
different times):
- `delay`: exact match after a fixed `--delay-s` sleep (a remote verifier, an LLM judge);
- `sandbox`: exact match after running a small Python program on `--sandbox-tests` tests in the real sandbox
  (app/rewards/sandbox.py: a fresh process group with limits, a temporary directory, no network), up to
  `--test-parallel` at once; each run also spends `--test-cpu-ms` of CPU (a test that computes).

For each, the same steps run with `reward.overlap=true` (each trajectory is scored the moment it finishes,
while the rest generate) and `reward.overlap=false` (the whole batch is generated, then scored), on the same
reward workers. The gain is bounded by how much scoring there is to hide: with generation G, scoring S and
the rest of the step F (train, push), after / overlapped <= (G + S + F) / (max(G, S) + F), so the 2x ceiling
needs S = G. `--match-scoring R` first runs a few scored-after steps to measure G and S, then sets the reward's
cost (`--delay-s` or `--test-cpu-ms`) so that S = R x G, and measures both modes with that cost.

`--context N` runs a copy of the embedded model with N positions (its RoPE has no position weights: the same
weights), so responses can be longer than the embedded model's 256 positions allow and G is long beside F.

Prints, per run, the mean step time (steps 2.., the first is warm-up) and the medians of its phases from
MLflow, then a final JSON line with after / overlapped for each reward.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.config import load_config
from app.rewards import exact_match
from bench.async_speedup import write_prompts
from bench.loop_setup import fresh_out_dir, start_local_ray

log = logging.getLogger("bench.reward_overlap")

PROGRAM = (
    "import sys, time\n"
    "end = time.process_time() + {cpu_s}\n"
    "while time.process_time() < end:\n"
    "    pass\n"
    "nums = [int(x) for x in sys.stdin.read().split()]\n"
    "print(max(nums))\n"
)
TESTS = [("3 8 1 5", "8"), ("9 2 7 4", "9"), ("1 1 6 0", "6"), ("5 2 2 5", "5")]
PARAMS_ENV = "RELAY_BENCH_REWARD_PARAMS"  # a JSON file: the reward's cost, read at each call


def _params() -> dict:
    return json.loads(Path(os.environ[PARAMS_ENV]).read_text())


def delay_reward(response: str, answer: str) -> float:
    time.sleep(float(_params()["delay_s"]))
    return exact_match(response, answer)


def sandbox_reward(response: str, answer: str) -> dict[str, float]:
    """The cost of a real code reward: sandboxed runs of a program on `sandbox_tests` tests (a code task's
    hidden tests; up to `test_parallel` of them at once, as `code_reward` runs them), then exact match."""
    from app.rewards.code import run_tests

    p = _params()
    n = int(p["sandbox_tests"])
    tests = [{"input": TESTS[i % len(TESTS)][0], "output": TESTS[i % len(TESTS)][1]} for i in range(n)]
    program = PROGRAM.format(cpu_s=float(p["test_cpu_ms"]) / 1000.0)
    checked = run_tests(program, tests, deadline=time.monotonic() + 60, parallel=int(p["test_parallel"]))
    ok = sum(outcome == "pass" for outcome, _ in checked)
    return {"score": exact_match(response, answer), "sandbox_tests_passed": ok / n}


REWARD_FNS = {"delay": "bench.reward_overlap:delay_reward", "sandbox": "bench.reward_overlap:sandbox_reward"}
COST_KNOB = {"delay": "delay_s", "sandbox": "test_cpu_ms"}  # what --match-scoring sets


def long_context_model(cache_dir: str, positions: int, seed: int) -> str:
    """A copy of the embedded model whose config allows `positions` positions (same weights: RoPE has none)."""
    from app.tasks.tiny import ensure_builtin

    dst = Path(cache_dir) / f"bench-tiny-ctx{positions}-seed{seed}" / "model"
    if (dst / "config.json").exists():
        return str(dst)
    tmp = dst.parent / "model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(ensure_builtin(cache_dir, seed=seed) / "model", tmp)
    for name, key in (
        ("config.json", "max_position_embeddings"),
        ("tokenizer_config.json", "model_max_length"),
    ):
        f = tmp / name
        doc = json.loads(f.read_text())
        doc[key] = positions
        f.write_text(json.dumps(doc, indent=1))
    tmp.rename(dst)
    return str(dst)


def run_timings(res: dict) -> dict[str, float]:
    """Mean step time (steps 2..) and the medians of its phases, from the run's MLflow metrics."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(res["tracking_uri"])

    def series(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(res["run_id"], key) if m.step >= 2}

    step, gen, after = series("timing/step_s"), series("timing/generate_s"), series("timing/reward_after_s")
    if not step:
        raise RuntimeError(f"run {res['run_id']} logged no timing/step_s after step 1: give it --steps >= 2")
    out = {
        "step_s": statistics.fmean(step.values()),
        "generate_s": statistics.median(gen.values()),  # with the scoring of the batch when it is after
        "train_s": statistics.median(series("timing/train_s").values()),
        "push_s": statistics.median(series("sync/time_s").values() or [0.0]),
        "steps_measured": len(step),
    }
    if after:  # scored after: generation alone and scoring alone
        out["generation_only_s"] = statistics.median(gen[k] - after.get(k, 0.0) for k in gen)
        out["scoring_after_s"] = statistics.median(after.values())
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def matched_cost(kind: str, params: dict, t: dict, units: int, ratio: float) -> float:
    """The reward cost (`COST_KNOB[kind]`) that makes scoring the batch take `ratio` x generation, from a
    scored-after run: scoring is `units` sequential costs of (overhead + knob) on the reward lanes."""
    scale = 1000.0 if kind == "sandbox" else 1.0  # test_cpu_ms is in ms
    per_unit = t["scoring_after_s"] / units
    overhead = per_unit - params[COST_KNOB[kind]] / scale
    want = ratio * t["generation_only_s"] / units
    if want < overhead:
        log.warning(
            "scoring without any added cost (%.3f s a unit) already exceeds %.2f x generation: cost 0",
            overhead,
            ratio,
        )
    return round(max(0.0, want - overhead) * scale, 4)


def cost_units(kind: str, args: argparse.Namespace) -> int:
    """Sequential reward costs in scoring one batch: samples per lane, times rounds of a sample's tests."""
    lanes = args.workers * args.max_concurrency
    per_lane = math.ceil(args.batch_groups * args.n / lanes)
    return per_lane * (math.ceil(args.sandbox_tests / args.test_parallel) if kind == "sandbox" else 1)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch-groups", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--lengths", default="pareto:1.2:16")
    ap.add_argument("--context", type=int, default=0, help="positions of a long-context copy of the model")
    ap.add_argument("--delay-s", type=float, default=0.5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--sandbox-tests", type=int, default=2, help="sandboxed runs per sample (hidden tests)")
    ap.add_argument("--test-parallel", type=int, default=4, help="a sample's tests run at once (sandbox)")
    ap.add_argument("--test-cpu-ms", type=float, default=0.0, help="CPU each sandboxed test run spends")
    ap.add_argument(
        "--match-scoring", type=float, default=0.0, help="set the cost so scoring = R x generation"
    )
    ap.add_argument("--calibrate-steps", type=int, default=3)
    ap.add_argument("--rewards", default="delay,sandbox")
    ap.add_argument("--gpu", action="store_true", help="configs/gpu1.yaml: replica and trainer share one GPU")
    ap.add_argument("--cache-dir", default=".cache/relay")
    ap.add_argument("--out", default="runs/bench_reward_overlap")
    return ap.parse_args()


def common_overrides(args: argparse.Namespace, out: Path) -> list[str]:
    data = Path(tempfile.mkdtemp(prefix="relay-bench-")) / "train.jsonl"
    write_prompts(args.cache_dir, data, args.steps * args.batch_groups)
    common = [
        "algorithm.mode=sync",
        f"data.train={data}",
        "data.epochs=1",
        "data.shuffle=false",
        "data.val_size=4",
        "algorithm.val_every=100000",
        f"train.batch_groups={args.batch_groups}",
        "train.compile=off",  # the tiny model: a compile warm-up would only lengthen each cold start
        f"rollout.n={args.n}",
        f"rollout.max_tokens={args.max_tokens}",
        f"rollout.max_model_len={args.max_tokens + 64}",
        "rollout.ignore_eos=true",
        f"rollout.lengths={args.lengths}",
        f"reward.workers={args.workers}",
        f"reward.max_concurrency={args.max_concurrency}",
        "reward.timeout_s=120",
        f"model.cache_dir={args.cache_dir}",
        f"run_dir={out}",
    ]
    if args.context:
        seed = load_config(None, []).seed
        common += [
            f"model.path={long_context_model(args.cache_dir, args.context, seed)}",
            "model.allow_toy_settings=true",
        ]
    return common


def start_ray(params_file: Path) -> None:
    env = {PARAMS_ENV: str(params_file), "PYTHONPATH": str(Path.cwd())}
    if os.environ.get("PYTHONPATH"):  # e.g. the GPU machine's overlay
        env["PYTHONPATH"] += os.pathsep + os.environ["PYTHONPATH"]
    env["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"] = "1"  # as app.driver.start_ray: no GPU for roles without one
    os.environ.update(env)
    start_local_ray(env=env)


def measure(
    kind: str, overlap: bool, steps: int, args: argparse.Namespace, common: list[str], tag: str
) -> dict:
    from app import driver

    name = f"{kind}-{tag}"
    cfg = load_config(
        "gpu1" if args.gpu else None,
        [
            *common,
            f"train.steps={steps}",
            f"reward.fn={REWARD_FNS[kind]}",
            f"reward.overlap={str(overlap).lower()}",
            f"ray.name=rw-{name}",
            f"tracking.run_name={name}",
        ],
    )
    res = driver.run(cfg)
    t = {**run_timings(res), "loop_step_s": round(res["loop_s"] / max(1, res["steps"]), 3)}
    log.info("%s: %s", name, json.dumps(t))
    return t


def bench_reward(
    kind: str, args: argparse.Namespace, common: list[str], params_file: Path, params: dict
) -> dict:
    """Scored after vs as finished for one reward (after a calibration run with --match-scoring)."""
    out: dict = {}
    if args.match_scoring:
        t = measure(kind, False, args.calibrate_steps, args, common, "calibrate")
        params[COST_KNOB[kind]] = matched_cost(kind, params, t, cost_units(kind, args), args.match_scoring)
        params_file.write_text(json.dumps(params))
        out["calibration"] = t
        log.info(
            "%s: %s=%s for scoring = %.2f x generation",
            kind,
            COST_KNOB[kind],
            params[COST_KNOB[kind]],
            args.match_scoring,
        )
    out["cost"] = {COST_KNOB[kind]: params[COST_KNOB[kind]]}
    out["after"] = measure(kind, False, args.steps, args, common, "after")
    out["overlap"] = measure(kind, True, args.steps, args, common, "overlap")
    out["after_over_overlap"] = round(out["after"]["step_s"] / out["overlap"]["step_s"], 3)
    a = out["after"]
    g, s, f = (
        a["generation_only_s"],
        a["scoring_after_s"],
        a["step_s"] - a["generation_only_s"] - a["scoring_after_s"],
    )
    out["bound"] = round(
        (g + s + f) / (max(g, s) + f), 3
    )  # a perfect overlap: scoring hidden behind generation
    return out


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import ray

    out = fresh_out_dir(args.out)
    common = common_overrides(args, out)
    params_file = out / "reward_params.json"
    base = {
        "delay_s": args.delay_s,
        "sandbox_tests": args.sandbox_tests,
        "test_parallel": args.test_parallel,
        "test_cpu_ms": args.test_cpu_ms,
    }
    start_ray(params_file)  # each reward writes its parameters before its first run
    results: dict[str, dict] = {}
    try:
        for kind in args.rewards.split(","):
            params = dict(base)
            params_file.write_text(json.dumps(params))
            results[kind] = bench_reward(kind, args, common, params_file, params)
    finally:
        ray.shutdown()
    summary = {
        "bench": "reward_overlap",
        "args": vars(args),
        "samples_per_step": args.batch_groups * args.n,
        "results": results,
        "after_over_overlap": {k: v["after_over_overlap"] for k, v in results.items()},
    }
    sys.stdout.write(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()
