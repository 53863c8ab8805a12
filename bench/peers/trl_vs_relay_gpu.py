"""Relay beside TRL's `GRPOTrainer` (vLLM colocate) on one GPU: a Qwen2.5 shape with random weights and
fixed-length responses, trained response tokens per second of each loop. One JSON line.

    python bench/peers/trl_vs_relay_gpu.py --system relay --modes sync > sync.out
    python bench/peers/trl_vs_relay_gpu.py --system relay --modes one_step_off > off.out
    python bench/peers/trl_vs_relay_gpu.py --system trl --with sync.out off.out   # + both and the ratios
    python bench/peers/trl_vs_relay_gpu.py --system relay --modes sync rollout.behaviour_logprobs=trainer

Config overrides after the flags go to Relay's every mode; its entry is then named `MODE+OVERRIDE,...` (a run
without them stays `MODE`), so runs of one mode with other settings sit side by side under `--with`.

Each system (and each Relay mode: an engine with CUDA graphs and a 1.5B trainer take 5-6 minutes) runs in a
call of its own; each Relay run leaves a 1.5B checkpoint of about 20 GB under runs/bench_async_speedup, which a
small disk must lose between calls. `--with` adds earlier calls' lines, and the last line then holds both
systems, `ratio` (Relay's best mode's tokens/s over TRL's, whole loops) and `steady_ratio` (between the first
and the last step, as bench/async_speedup.py's `steady_tokens_per_s`). Only runs of the same `SAME` settings
compare.

The job (the workload (b) of the peers comparison): `bench/qwen_shapes.py`'s shape (default 1.5B: random
weights, a full 151,936-token synthetic tokenizer), `--prompts` prompts of the built-in task, `--batch-groups`
prompts x `--n` samples a step, every response exactly `--max-tokens` tokens (EOS ignored in both systems), no
KL, one update a batch, bf16. Throughput, not learning: rewards are near zero on random weights in both, and
neither system skips a batch for it.

- **Relay**: `bench/async_speedup.py --gpu` (configs/gpu1.yaml: the vLLM replica at 0.4 of the GPU, the FSDP2
  trainer beside it, CUDA-IPC pushes) with `rollout.cuda_graphs=true`; its `tokens_per_s` per mode.
- **TRL** (`trl==1.16.0`): bench/peers/trl_run.py with `use_vllm=True, vllm_mode="colocate"` (vLLM in the
  trainer's process, its default CUDA graphs and compile, weights loaded in place after each step), the
  `GRPOConfig` of `trl_settings` (bench/peers/trl_vs_relay.py: every setting TRL must be told to match Relay)
  for Relay's resolved config, and the GPU settings below, each with its comment. Its `loop_s` runs from the
  end of the first validation to the end of the last optimizer step, as Relay's from the first step to the
  last push.

Not held equal: Relay trains the prompts in its seeded order and TRL in file order (every response has the
same length, so the work is the same); TRL's vLLM runs with its own `max_num_batched_tokens=4096`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.async_speedup import last_json_line, steady_tokens_per_s
from bench.peers.trl_vs_relay import parse_result, read_metrics

log = logging.getLogger("bench.peers.gpu")
REPO = Path(__file__).resolve().parents[2]
OVERRIDES = ("train.lr=1e-6",)
"""Both systems' config overrides (TRL's through `trl_settings`): an lr that keeps random bf16 weights finite."""
SAME = ("shape", "prompts", "batch_groups", "n", "max_tokens")
"""The settings two calls must share for their figures to compare (`--with`)."""


def job_args(args: argparse.Namespace) -> argparse.Namespace:
    """`bench/async_speedup.py`'s arguments for this job (its `common_overrides` builds both systems' data)."""
    return argparse.Namespace(
        cache_dir=args.cache_dir,
        prompts=args.prompts,
        batch_groups=args.batch_groups,
        n=args.n,
        max_tokens=args.max_tokens,
        lengths="fixed",
        shape=args.shape,
        models=args.models,
    )


def run_relay(args: argparse.Namespace) -> dict[str, Any]:
    """`bench/async_speedup.py --gpu` on this job: its final JSON line's modes."""
    cmd = [
        sys.executable,
        str(REPO / "bench" / "async_speedup.py"),
        "--gpu",
        f"--shape={args.shape}",
        f"--prompts={args.prompts}",
        f"--batch-groups={args.batch_groups}",
        f"--n={args.n}",
        f"--max-tokens={args.max_tokens}",
        "--lengths=fixed",
        f"--modes={args.modes}",
        f"--models={args.models}",
        f"--cache-dir={args.cache_dir}",
        "rollout.cuda_graphs=true",  # the GPU presets' setting (TRL's vLLM captures graphs by default)
        *OVERRIDES,
        *args.overrides,  # last: they win
    ]
    out = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, check=True).stdout
    line = [ln for ln in out.splitlines() if ln.startswith("{")][-1]
    modes = json.loads(line)["modes"]
    keep = ("steps", "trained_tokens", "loop_s", "tokens_per_s", "steady_tokens_per_s")
    return {entry_name(m, args.overrides): {k: r[k] for k in keep} for m, r in modes.items()}


def entry_name(mode: str, overrides: list[str]) -> str:
    """A Relay run's key in the summary: its mode, and the config overrides it ran with beyond the bench's."""
    return "+".join([mode, ",".join(overrides)]) if overrides else mode


def gpu_settings(cfg: dict[str, Any], micro: int) -> dict[str, Any]:
    """What TRL needs besides `trl_settings` on one GPU: its vLLM colocated, Relay's sampling lengths."""
    r = cfg["rollout"]
    completions = cfg["train"]["batch_groups"] * r["n"]
    if completions % micro:
        raise ValueError(f"--micro {micro} must divide the {completions} completions of a step")
    return {
        "use_cpu": False,
        "use_vllm": True,
        "vllm_mode": "colocate",  # in the trainer's process, as TRL's single-GPU recipe
        "vllm_gpu_memory_utilization": r["replica_gpus"],  # Relay's replica takes this share of the GPU
        "vllm_max_model_length": r["max_model_len"],
        "vllm_enable_sleep_mode": False,  # TRL's default: the engine keeps its memory through the step
        "generation_kwargs": {"ignore_eos": True},  # every response exactly max_tokens long, as Relay's
        # one generation of every completion, then one optimizer step over `micro`-completion micro-batches
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": completions // micro,
        "generation_batch_size": completions,  # (TRL refuses steps_per_generation beside it)
    }


def run_trl(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """TRL on this job: bench/peers/trl_run.py's RESULT with `tokens_per_s`."""
    from omegaconf import OmegaConf

    from app.preflight import load_config
    from bench.async_speedup import common_overrides
    from bench.peers.trl_vs_relay import trl_settings, unmatched

    common, n_prompts = common_overrides(job_args(args), work)
    cfg = OmegaConf.to_container(
        load_config("gpu1", [*common, "algorithm.mode=sync", *OVERRIDES]), resolve=True
    )
    if bad := unmatched(cfg):
        raise SystemExit(f"settings TRL cannot match: {', '.join(bad)}")
    steps = n_prompts // cfg["train"]["batch_groups"]
    grpo = {**trl_settings(cfg, str(work / "trl")), **gpu_settings(cfg, args.micro), "max_steps": steps}
    data = next(o.split("=", 1)[1] for o in common if o.startswith("data.train="))
    model = next(o.split("=", 1)[1] for o in common if o.startswith("model.path="))
    settings = {
        "grpo": grpo,
        "model": model,
        "train": data,
        "val": data,  # validation is left out of both loops; two prompts, eight tokens
        "val_size": 2,
        "val_every": 10 * steps,
        "max_tokens": 8,
        "metrics": str(work / "trl_metrics.jsonl"),
        "final": str(work / "trl_final"),
    }
    path = work / "trl_settings.json"
    path.write_text(json.dumps(settings, indent=1))
    cmd = [sys.executable, str(REPO / "bench" / "peers" / "trl_run.py"), str(path)]
    res = parse_result(subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, check=True).stdout)
    if not res:
        raise RuntimeError(f"{cmd[1]} printed no RESULT line")
    steady = steady_tokens_per_s(step_points(Path(settings["metrics"])))
    return {
        **res,
        "tokens_per_s": round(res["trained_tokens"] / res["loop_s"], 1),
        "steady_tokens_per_s": round(steady, 1),
    }


def step_points(metrics: Path) -> list[tuple[int, float, float]]:
    """(step, logged at, trained tokens) of each step in trl_run.py's metrics file (its `tokens` lines), as
    `bench.async_speedup.steady_points` reads Relay's."""
    return [(r["step"], r["time"], r["tokens"]) for r in read_metrics(metrics.read_text()) if "tokens" in r]


def with_ratios(summary: dict[str, Any]) -> dict[str, Any]:
    """`summary` with `ratio` (Relay's best mode's tokens/s over TRL's, whole loops) and `steady_ratio` (the
    same between the first and the last step: warm-up and wind-down left out, `steady_tokens_per_s`), each
    with the mode it names; unchanged until both systems ran."""
    relay, trl = summary.get("relay"), summary.get("trl")
    if not relay or not trl:
        return summary
    out = dict(summary)
    for key, name in (("tokens_per_s", "ratio"), ("steady_tokens_per_s", "steady_ratio")):
        finite = {m: r[key] for m, r in relay.items() if r.get(key) == r.get(key)}  # NaN: too few steps
        if finite and trl.get(key) == trl.get(key) and trl.get(key):
            mode = max(finite, key=finite.get)
            out[name] = {"mode": mode, "value": round(finite[mode] / trl[key], 3)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system", choices=["relay", "trl"], required=True)
    ap.add_argument("--shape", default="1.5B")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--batch-groups", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--modes", default="sync,one_step_off", help="Relay's modes")
    ap.add_argument("--micro", type=int, default=8, help="TRL's completions per micro-batch")
    ap.add_argument("--models", default=os.path.join(tempfile.gettempdir(), "relay-models"))
    ap.add_argument("--cache-dir", default=".cache/relay")
    ap.add_argument("--with", dest="earlier", nargs="*", default=[], metavar="FILE")
    ap.add_argument(
        "overrides", nargs="*", help="Relay's config overrides, e.g. rollout.behaviour_logprobs=trainer"
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    summary: dict[str, Any] = {"bench": "trl_vs_relay_gpu", **{k: getattr(args, k) for k in SAME}}
    for path in args.earlier:
        other = last_json_line(path)
        bad = [k for k in SAME if other.get(k) != summary[k]]
        if bad:
            raise SystemExit(f"{path} ran with other {', '.join(bad)}: only runs of the same {SAME} compare")
        summary.setdefault("relay", {}).update(other.get("relay", {}))  # Relay's modes, one call each
        summary.update({"trl": other["trl"]} if "trl" in other else {})
    if args.system == "relay":
        summary.setdefault("relay", {}).update(run_relay(args))
    else:
        import importlib.metadata

        work = Path(tempfile.mkdtemp(prefix="relay-peers-gpu-"))
        summary["trl"] = {**run_trl(args, work), "version": importlib.metadata.version("trl")}
    sys.stdout.write(json.dumps(with_ratios(summary)) + "\n")


if __name__ == "__main__":
    main()
