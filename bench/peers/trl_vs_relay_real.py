"""Relay beside TRL's `GRPOTrainer` (vLLM colocate) on one GPU with a real model: SmolLM2-135M-Instruct on
the GSM8K-layout word problems of `--config gsm8k`, each system with its own recipe for one GPU; wall time
to a validation reward, the curve, trained tokens per second and memory. One JSON line.

    python bench/peers/trl_vs_relay_real.py --system relay > relay.out       # python -m app train --config gsm8k
    python bench/peers/trl_vs_relay_real.py --system trl --with relay.out    # TRL on the same job; both + ratios

Each system runs in a command of its own (7-8 minutes each on an H200); TRL's call needs Relay's line, which
holds the order Relay trained the prompts in. `--with` adds the earlier line, and the last line then holds
both systems and `ratios` (Relay's figure over TRL's, as bench/peers/trl_vs_relay.py's).

The job, held equal: the model (`builtin:smollm2-135m`, the same converted folder), the prompts and their
order (TRL is fed the train rows in the order Relay trained them, from its `trained_groups.jsonl`), the
reward (Relay's `gsm8k_shaped` on the decoded response: 1.0 strict `#### N`, 0.8 the last number, 0.1 the
format), 32 prompts x 8 samples a step, at most 512 response tokens, temperature 1, AdamW at lr 1e-5 (betas,
eps, clip 1.0) with 5 warm-up steps, the token-mean loss clipped at 0.2/0.28, no KL, bf16, the steps, and the
validation: greedy answers to the 200 held-out problems before the first step, every 10 steps and after the
last, scored with the same reward (its strict and flexible sub-scores beside it).

Not held equal, on purpose (each system as its user would run it on one GPU):
- the schedule: Relay's preset is `fully_async` (`max_staleness=1`, the decoupled correction), its vLLM
  replica and FSDP2 trainer sharing the GPU (CUDA-IPC pushes); TRL's single-GPU recipe is synchronous, its
  vLLM in the trainer's process (`vllm_mode="colocate"`) at the replica's share of the memory (0.5), weights
  loaded in place after each step.
- the validation's generator: Relay's replica (vLLM, greedy); TRL's trainer model (HF `generate`, greedy),
  as bench/peers/trl_run.py does. Its time is in `val_s`; `time_to_threshold_s` counts it,
  `time_to_threshold_train_s` leaves every validation before it out.
- the warm-up: Relay's ramp is (step + 1) / 5 of the lr, TRL's (`constant_with_warmup`) step / 5, a step
  later.
- micro-batches: Relay packs them by tokens; TRL takes `--micro` completions each (8 accumulated a step).

Figures per system (bench/peers/trl_vs_relay.py's `figures`): tokens_per_s (response tokens trained per
second of the loop, validations inside it left out), startup_s, time_to_threshold_s (from the command's
start to the first validation with reward >= `--threshold`), wall_s, the validation curve, peak RSS of the
process tree, CPU seconds per step, and peak_gpu_mib (`nvidia-smi`'s memory used, sampled every second).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.async_speedup import last_json_line
from bench.peers.trl_vs_relay import (
    Finished,
    become_subreaper,
    figures,
    ratios,
    read_metrics,
    relay_commit,
    rounded,
    run_measured,
    trained_order,
    trl_settings,
    unmatched,
)
from bench.peers.trl_vs_relay_gpu import gpu_settings

log = logging.getLogger("bench.peers.real")
ROOT = Path(__file__).resolve().parents[2]
PRESET = "gsm8k"
# the settings in which the two recipes differ on purpose (the module docstring): left out of `unmatched`
RECIPE_KEYS = ("algorithm.mode", "algorithm.correction", "train.warmup_steps", "reward.fn")
EXTRA_RATIOS = ("time_to_threshold_train_s", "peak_gpu_mib")
SAME = ("steps", "threshold", "overrides")
"""The settings two calls must share for their figures to compare (`--with`)."""


class GpuSampler:
    """The largest `memory.used` (MiB) `nvidia-smi` reports over the machine's GPUs, sampled every second in
    a thread; 0 where there is no `nvidia-smi`."""

    def __init__(self, interval: float = 1.0) -> None:
        self.interval, self.peak = interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="gpu-sampler")

    def __enter__(self) -> GpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        cmd = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        while not self._stop.wait(self.interval):
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.SubprocessError):
                return
            used = [int(x) for x in out.split() if x.strip().isdigit()]
            self.peak = max([self.peak, *used])


def relay_overrides(work: Path, steps: int, extra: list[str]) -> list[str]:
    """`python -m app train --config gsm8k` overrides for this bench's Relay run."""
    return [
        f"run_dir={work / 'relay-runs'}",
        "tracking.run_name=relay",
        "tracking.uri=",  # local: a SQLite store under run_dir
        f"train.steps={steps}",
        *extra,
    ]


def resolved(overrides: list[str]) -> dict[str, Any]:
    """The preset's resolved config with `overrides`."""
    from omegaconf import OmegaConf

    from app.preflight import load_config

    return OmegaConf.to_container(load_config(PRESET, overrides), resolve=True)


def threshold_train_s(metrics: list[dict[str, Any]], t0: float, threshold: float) -> Any:
    """Seconds from the start to the first validation reaching `threshold`, every validation before it (its
    own included) left out; None where none reached it."""
    vals = sorted((m for m in metrics if "val/reward" in m), key=lambda m: m["time"])
    spent = 0.0
    for m in vals:
        spent += m.get("timing/val_s", 0.0)
        if m["val/reward"] >= threshold:
            return m["time"] - t0 - spent
    return None


def real_figures(fin: Finished, metrics: list[dict[str, Any]], args: argparse.Namespace, gpu: int) -> dict:
    """One run's figures: `figures`, the strict sub-score's curve, the threshold without validations and the
    GPU peak."""
    out = figures(fin, metrics, args.threshold)
    strict = [m for m in metrics if "val/sub/strict" in m]
    out.update(
        time_to_threshold_train_s=threshold_train_s(metrics, fin.t0, args.threshold),
        val_s=sum(m.get("timing/val_s", 0.0) for m in metrics if "val/reward" in m),
        strict_curve=[[m["step"], round(m["val/sub/strict"], 4)] for m in strict],
        peak_gpu_mib=gpu,
    )
    return out


def run_relay(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """`python -m app train --config gsm8k` measured (the model and task built before): its figures and the
    order it trained the prompts in."""
    from app.tasks import model_folder

    overrides = relay_overrides(work, args.steps, args.overrides)
    cfg = resolved(overrides)
    cache, seed = cfg["model"]["cache_dir"], cfg["seed"]
    model_folder(cfg["model"]["path"], cache, seed)  # built (converted) before the clock starts, as TRL's
    task(cfg)
    cmd = [sys.executable, "-m", "app", "train", "--config", PRESET, *overrides]
    log.info("Relay: %s", " ".join(cmd[1:]))
    with GpuSampler() as gpu:
        fin = run_measured("relay", cmd, work / "relay.log")
    run_dir = work / "relay-runs" / "relay"
    metrics = read_metrics((run_dir / "metrics.jsonl").read_text())
    order = trained_order(run_dir / "trained_groups.jsonl", args.steps, cfg["train"]["batch_groups"])
    return {**rounded(real_figures(fin, metrics, args, gpu.peak)), "order": order}


def task(cfg: dict[str, Any]) -> Path:
    """The folder (train.jsonl, val.jsonl) of the config's built-in task, built on first use."""
    from app.tasks import TASKS, task_folder

    spec = cfg["data"]["train"]
    if spec not in TASKS or cfg["data"]["val"] != spec:
        raise SystemExit(f"data.train={spec!r}: this bench takes one of {sorted(TASKS)} for train and val")
    return task_folder(spec, cfg["model"]["cache_dir"], cfg["seed"])


def trl_grpo(cfg: dict[str, Any], out_dir: str, micro: int, share: float) -> dict[str, Any]:
    """TRL's `GRPOConfig` for the preset's job: `trl_settings` of its sync twin, the GPU's (vLLM colocated
    at `share` of the memory, `micro`-completion micro-batches), the warm-up of the preset."""
    bad = [p for p in unmatched(cfg) if not p.startswith(RECIPE_KEYS)]
    if bad:
        raise SystemExit(f"settings TRL cannot match: {', '.join(bad)}")
    grpo = {**trl_settings(cfg, out_dir), **gpu_settings(cfg, micro)}
    grpo.pop("generation_kwargs")  # responses end at EOS, as Relay's (gpu_settings' fixed lengths are off)
    warm = cfg["train"]["warmup_steps"]
    grpo.update(
        vllm_gpu_memory_utilization=share,
        lr_scheduler_type="constant_with_warmup" if warm else "constant",
        warmup_steps=warm,
    )
    return grpo


def trl_job(args: argparse.Namespace, work: Path, order: list[str]) -> Path:
    """Write TRL's settings (and its train rows in Relay's order); returns the settings file."""
    from app.rewards import BUILTINS
    from app.tasks import model_folder

    cfg = resolved(relay_overrides(work, args.steps, args.overrides))
    reward, cache = cfg["reward"]["fn"], cfg["model"]["cache_dir"]
    if reward not in BUILTINS:
        raise SystemExit(f"reward.fn={reward!r}: this bench takes one of Relay's built-in rewards")
    folder = task(cfg)
    rows = {}
    for line in (folder / "train.jsonl").read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            rows[rec["id"]] = rec
    ordered = work / "trl-train-order.jsonl"
    ordered.write_text("".join(json.dumps(rows[uid]) + "\n" for uid in order))
    settings = {
        "grpo": trl_grpo(cfg, str(work / "trl-out"), args.micro, args.vllm_share),
        "model": str(model_folder(cfg["model"]["path"], cache, cfg["seed"])),
        "train": str(ordered),
        "val": str(folder / "val.jsonl"),
        "val_size": cfg["data"]["val_size"],
        "val_every": cfg["algorithm"]["val_every"],
        "max_tokens": cfg["rollout"]["max_tokens"],
        "reward": reward,
        "metrics": str(work / "trl-metrics.jsonl"),
        "final": str(work / "trl-final"),
    }
    path = work / "trl-settings.json"
    path.write_text(json.dumps(settings, indent=1))
    return path


def run_trl(args: argparse.Namespace, work: Path, order: list[str]) -> dict[str, Any]:
    """bench/peers/trl_run.py on the job, measured."""
    path = trl_job(args, work, order)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    cmd = [sys.executable, str(Path(__file__).with_name("trl_run.py")), str(path)]
    log.info("TRL: %s", " ".join(cmd[1:]))
    with GpuSampler() as gpu:
        fin = run_measured("trl", cmd, work / "trl.log", env)
    metrics = read_metrics((work / "trl-metrics.jsonl").read_text())
    import importlib.metadata

    version = importlib.metadata.version("trl")
    return {**rounded(real_figures(fin, metrics, args, gpu.peak)), "version": version}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system", choices=["relay", "trl"], required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threshold", type=float, default=0.4, help="the validation reward timed to")
    ap.add_argument("--micro", type=int, default=32, help="TRL's completions per micro-batch")
    ap.add_argument("--vllm-share", type=float, default=0.5, help="TRL's vLLM share of the GPU's memory")
    ap.add_argument("--work-dir", default="", help="where runs go (default: runs/peers-real/<time>)")
    ap.add_argument("--with", dest="earlier", default="", metavar="FILE", help="Relay's earlier line")
    ap.add_argument("overrides", nargs="*", help="config overrides for both systems (key=value)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not become_subreaper():
        log.warning("not a child subreaper: daemons that detach leave the measured process tree")
    work = Path(args.work_dir or ROOT / "runs" / "peers-real" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"bench": "trl_vs_relay_real", "preset": PRESET}
    summary.update({k: getattr(args, k) for k in SAME})
    with contextlib.suppress(OSError):  # a copy of the tree without git: no commit to name
        summary["relay_commit"] = relay_commit()
    if args.earlier:
        other = last_json_line(args.earlier)
        if bad := [k for k in SAME if other.get(k) != summary[k]]:
            raise SystemExit(
                f"{args.earlier} ran with other {', '.join(bad)}: only runs of equal {SAME} compare"
            )
        summary["relay"] = other["relay"]
    if args.system == "relay":
        summary["relay"] = run_relay(args, work)
    else:
        if "relay" not in summary:
            raise SystemExit("TRL trains the prompts in Relay's order: pass Relay's line with --with FILE")
        summary["trl"] = run_trl(args, work, summary["relay"]["order"])
        relay = {k: v for k, v in summary["relay"].items() if k != "order"}
        summary["ratios"] = ratios(relay, summary["trl"]) | {
            k: round(relay[k] / summary["trl"][k], 3) if relay.get(k) and summary["trl"].get(k) else None
            for k in EXTRA_RATIOS
        }
    with contextlib.suppress(OSError):
        (work / f"{args.system}.json").write_text(json.dumps(summary) + "\n")
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
