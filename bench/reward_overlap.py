"""Step time with rewards overlapped with generation vs computed after it, one run.

    python bench/reward_overlap.py [--steps 12] [--delay-s 0.5] [--sandbox-tests 2] [--workers 2] [--max-concurrency 8]

Two costly rewards on the built-in task (sync mode, long-tailed response lengths so trajectories finish at
different times):
- `delay`: exact match after a fixed `--delay-s` sleep (a remote verifier, an LLM judge);
- `sandbox`: exact match after running a small Python program with tests in the real sandbox
  (app/sandbox.py: a fresh process group with limits, a temporary directory, no network).

For each, the same steps run with `reward.overlap=true` (each trajectory is scored the moment it finishes,
while the rest generate) and `reward.overlap=false` (the whole batch is generated, then scored), on the same
reward workers. Prints the mean step time of each and the ratio (after / overlapped) in a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.config import load_config
from app.rewards import exact_match
from bench.async_speedup import write_prompts

log = logging.getLogger("bench.reward_overlap")

PROGRAM = "import sys\nnums = [int(x) for x in sys.stdin.read().split()]\nprint(max(nums))\n"


def delay_reward(response: str, answer: str) -> float:
    time.sleep(float(os.environ.get("RELAY_BENCH_REWARD_DELAY_S", "0.5")))
    return exact_match(response, answer)


TESTS = [("3 8 1 5", "8"), ("9 2 7 4", "9"), ("1 1 6 0", "6"), ("5 2 2 5", "5")]


def sandbox_reward(response: str, answer: str) -> dict[str, float]:
    """The cost of a real code reward: sandboxed runs of a program on `--sandbox-tests` tests (a code task's
    hidden tests; up to `--test-parallel` of them at once, as `code_reward` runs them), then exact match."""
    from app.sandbox import run_tests

    n = int(os.environ.get("RELAY_BENCH_SANDBOX_TESTS", "2"))
    parallel = int(os.environ.get("RELAY_BENCH_TEST_PARALLEL", "4"))
    tests = [{"input": TESTS[i % len(TESTS)][0], "output": TESTS[i % len(TESTS)][1]} for i in range(n)]
    checked = run_tests(PROGRAM, tests, deadline=time.monotonic() + 60, parallel=parallel)
    ok = sum(outcome == "pass" for outcome, _ in checked)
    return {"score": exact_match(response, answer), "sandbox_tests_passed": ok / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch-groups", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--lengths", default="pareto:1.2:16")
    ap.add_argument("--delay-s", type=float, default=0.5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--sandbox-tests", type=int, default=2, help="sandboxed runs per sample (hidden tests)")
    ap.add_argument("--test-parallel", type=int, default=4, help="a sample's tests run at once (sandbox)")
    ap.add_argument("--rewards", default="delay,sandbox")
    ap.add_argument("--gpu", action="store_true", help="configs/gpu1.yaml: replica and trainer share one GPU")
    ap.add_argument("--cache-dir", default=".cache/relay")
    ap.add_argument("--out", default="runs/bench_reward_overlap")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    import ray

    from app import driver

    out = Path(args.out).resolve() / time.strftime("%Y%m%d-%H%M%S")  # a fresh folder: runs never mix
    out.mkdir(parents=True, exist_ok=True)
    data = Path(tempfile.mkdtemp(prefix="relay-bench-")) / "train.jsonl"
    write_prompts(args.cache_dir, data, args.steps * args.batch_groups)
    common = [
        "algorithm.mode=sync",
        f"data.train={data}",
        "data.epochs=1",
        "data.shuffle=false",
        "data.val_size=4",
        "algorithm.val_every=100000",
        f"train.steps={args.steps}",
        f"train.batch_groups={args.batch_groups}",
        f"rollout.n={args.n}",
        f"rollout.max_tokens={args.max_tokens}",
        f"rollout.max_model_len={args.max_tokens + 64}",
        "rollout.ignore_eos=true",
        f"rollout.lengths={args.lengths}",
        f"reward.workers={args.workers}",
        f"reward.max_concurrency={args.max_concurrency}",
        "reward.timeout_s=60",
        f"model.cache_dir={args.cache_dir}",
        f"run_dir={out}",
    ]
    env = {
        "RELAY_BENCH_REWARD_DELAY_S": str(args.delay_s),
        "RELAY_BENCH_SANDBOX_TESTS": str(args.sandbox_tests),
        "RELAY_BENCH_TEST_PARALLEL": str(args.test_parallel),
        "PYTHONPATH": str(Path.cwd()),
    }
    if os.environ.get("PYTHONPATH"):  # e.g. the GPU machine's overlay
        env["PYTHONPATH"] += os.pathsep + os.environ["PYTHONPATH"]
    env["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"] = "1"  # as app.driver.start_ray: no GPU for roles without one
    os.environ.update(env)
    ray.init(
        address="local",
        num_cpus=16,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": env},
    )
    results: dict[str, dict] = {}
    try:
        for kind in args.rewards.split(","):
            fn = {
                "delay": "bench.reward_overlap:delay_reward",
                "sandbox": "bench.reward_overlap:sandbox_reward",
            }[kind]
            for overlap in (False, True):
                name = f"{kind}-{'overlap' if overlap else 'after'}"
                cfg = load_config(
                    "gpu1" if args.gpu else None,
                    [
                        *common,
                        f"reward.fn={fn}",
                        f"reward.overlap={str(overlap).lower()}",
                        f"ray.name=rw-{name}",
                        f"tracking.run_name={name}",
                    ],
                )
                res = driver.run(cfg)
                step_s = res["loop_s"] / max(1, res["steps"])
                results.setdefault(kind, {})["overlap" if overlap else "after"] = round(step_s, 3)
                log.info("%s: %.3f s per step", name, step_s)
    finally:
        ray.shutdown()
    summary = {
        "bench": "reward_overlap",
        "steps": args.steps,
        "samples_per_step": args.batch_groups * args.n,
        "delay_s": args.delay_s,
        "sandbox_tests": args.sandbox_tests,
        "test_parallel": args.test_parallel,
        "reward_workers": args.workers,
        "max_concurrency": args.max_concurrency,
        "gpu": args.gpu,
        "step_s": results,
        "after_over_overlap": {k: round(v["after"] / v["overlap"], 3) for k, v in results.items()},
    }
    sys.stdout.write(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()
