"""The driver: wires the roles of one run and returns its result.

    data     the prompt files (or the embedded task) -> rows; the rollouter streams them through Ray Data
    rollout  a Serve deployment of vLLM replicas; each registers with the weight hub
    train    a TorchTrainer whose workers run app/train_worker.py's loop (GRPO on FSDP2, weight pushes)
    track    one MLflow run: params and config here, metrics from trainer rank 0

Everything started here is stopped here, also when the run fails.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from app.config import flatten, to_container
from app.data import PromptRow, load_rows

log = logging.getLogger("app.driver")


@dataclass
class Inputs:
    model_path: str
    train_rows: list[PromptRow]
    val_rows: list[PromptRow]


def resolve_inputs(cfg: DictConfig) -> Inputs:
    """The model folder and the prompt rows, building the embedded default where asked."""
    root = None
    model_path = cfg.model.path
    if model_path == "builtin:tiny" or "builtin:arith" in (cfg.data.train, cfg.data.val):
        from app.tiny import ensure_builtin

        root = ensure_builtin(cfg.model.cache_dir, seed=cfg.seed)
    if model_path == "builtin:tiny":
        model_path = str(root / "model")
    elif model_path == "builtin:tiny-code":
        from app.tiny import ensure_builtin_code

        model_path = str(ensure_builtin_code(cfg.model.cache_dir, seed=cfg.seed) / "model")
    elif not Path(model_path, "config.json").exists():
        raise FileNotFoundError(
            f"model.path={model_path!r} is not an HF checkpoint folder (no config.json); "
            "point it at a local checkpoint or use builtin:tiny"
        )

    def rows(spec: str, split: str) -> list[PromptRow]:
        if spec == "builtin:arith":
            return load_rows(str(root / f"{split}.jsonl"))
        if spec == "builtin:code":
            from app.code_task import ensure_code_task

            return load_rows(str(ensure_code_task(cfg.model.cache_dir, seed=cfg.seed) / f"{split}.jsonl"))
        if spec.startswith("builtin:"):
            raise ValueError(
                f"data.{split}={spec!r}: unknown built-in task; available: builtin:arith, builtin:code"
            )
        return load_rows(spec)

    return Inputs(str(Path(model_path).resolve()), rows(cfg.data.train, "train"), rows(cfg.data.val, "val"))


def start_ray(cfg: DictConfig) -> bool:
    """Connect to (or start) Ray; returns True if this call started a local cluster."""
    import ray

    if ray.is_initialized():
        return False
    env = {"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS") or None
    if address:
        ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=True)
        return False
    # address="local": a new cluster even where /tmp/ray/ray_current_cluster names a stale one
    ray.init(address="local", num_cpus=cfg.ray.num_cpus, runtime_env={"env_vars": env}, log_to_driver=True)
    return True


def run(cfg: DictConfig) -> dict[str, Any]:
    """One training run. Returns the RESULT record; raises if the run failed."""
    import ray
    from ray import serve
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from app import checkpoint
    from app.rollouter import Rollouter, rollouter_name
    from app.serve_rollout import NAMESPACE, app_name, build_app, hub_name
    from app.sync import WeightHub
    from app.tracking import Tracker, default_uri
    from app.train_worker import train_worker
    from app.watchdog import REPORT as STALL_REPORT
    from app.watchdog import StallError, summarize

    t0 = time.time()
    resume = str(checkpoint.find(cfg.train.resume)) if cfg.train.resume else None  # fails early, clearly
    inputs = resolve_inputs(cfg)
    name = cfg.tracking.run_name or time.strftime("relay-%Y%m%d-%H%M%S")
    run_dir = Path(cfg.run_dir).resolve() / name
    if (run_dir / "ray_train").exists() and not resume:
        # Ray Train would quietly continue the earlier run's checkpoints under this name
        raise FileExistsError(
            f"{run_dir} already holds a run named {name!r}: continue it with `--resume {run_dir}`, or "
            "give this run another tracking.run_name (or run_dir)"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    uri = cfg.tracking.uri or default_uri(cfg.run_dir)
    tracker = Tracker.start(uri, cfg.tracking.experiment, name, flatten(cfg))
    tracker.artifact(str(run_dir / "config.yaml"))
    if resume:
        tracker.tags({"relay.resumed_from": resume})
        log.info("resuming from checkpoint %s", resume)
    log.info("run %s: MLflow run %s at %s", name, tracker.run_id, uri)
    tracker.start_system_metrics()

    started = start_ray(cfg)
    status = "FAILED"
    try:
        from app.resources import check as check_resources
        from app.resources import resolve as resolve_resources

        cluster = ray.cluster_resources()
        shares = resolve_resources(cfg, cluster)  # resources.* shares -> per-role settings
        if shares:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"{k}={v}" for k, v in shares.items()]))
            log.info("resources.* on this cluster: %s", shares)
        need = check_resources(cfg, cluster)  # refuse a plan that would wait forever
        log.info("resources by role: %s", need)
        hub = (
            ray.remote(WeightHub)
            .options(name=hub_name(cfg.ray.name), namespace=NAMESPACE, num_cpus=0)
            .remote()
        )
        serve.run(
            build_app(cfg, inputs.model_path),
            name=app_name(cfg.ray.name),
            route_prefix=None,
            external_scaler_enabled=cfg.rollout.scaling == "external",
        )
        rollouter = (
            ray.remote(Rollouter)
            .options(name=rollouter_name(cfg.ray.name), namespace=NAMESPACE, num_cpus=0, max_concurrency=256)
            .remote(to_container(cfg), inputs.model_path, inputs.train_rows, inputs.val_rows)
        )
        ray.get([rollouter.progress.remote(), hub.status.remote()], timeout=300)
        t = cfg.train
        trainer = TorchTrainer(
            train_worker,
            train_loop_config={
                "cfg": to_container(cfg),
                "model_path": inputs.model_path,
                "run_id": tracker.run_id,
                "tracking_uri": uri,
                "run_dir": str(run_dir),
                "resume": resume,
            },
            scaling_config=ScalingConfig(
                num_workers=t.workers, use_gpu=t.use_gpu, resources_per_worker={"CPU": t.worker_cpus}
            ),
            torch_config=TorchConfig(
                backend=None if t.backend == "auto" else t.backend,
                timeout_s=int(t.timeout_s + cfg.sync.timeout_s + 60),
            ),
            run_config=RunConfig(
                name=name,
                storage_path=str(run_dir / "ray_train"),
                checkpoint_config=CheckpointConfig(num_to_keep=t.keep_checkpoints),
                failure_config=FailureConfig(max_failures=t.max_failures),
            ),
        )
        restore = _graceful_stop(hub)
        stall = run_dir / STALL_REPORT
        try:
            result = trainer.fit()
        except Exception as e:  # Ray Train raises when the workers failed for good
            if stall.exists() and stall.stat().st_mtime >= t0:
                raise StallError(summarize(json.loads(stall.read_text()))) from e
            raise
        finally:
            restore()  # the weight group's membership history: who joined when, at which version, who left
            with contextlib.suppress(Exception):
                members = ray.get(hub.status.remote(), timeout=10)
                (run_dir / "rollout_members.json").write_text(json.dumps(members, indent=1))
                tracker.artifact(str(run_dir / "rollout_members.json"))
        if result.error:
            if stall.exists() and stall.stat().st_mtime >= t0:
                raise StallError(summarize(json.loads(stall.read_text()))) from result.error
            raise result.error
        summary = run_dir / "summary.json"
        if not summary.exists():
            raise RuntimeError(f"training ended without writing {summary}")
        m = json.loads(summary.read_text())
        status = "FINISHED"
        out = {
            "run_id": tracker.run_id,
            "tracking_uri": uri,
            "steps": m.get("steps"),
            "val_reward_first": m.get("val_reward_first"),
            "val_reward_last": m.get("val_reward_last"),
            "weight_version": m.get("weight_version"),
            "stopped": m.get("stopped"),
            "final_checkpoint": m.get("final_checkpoint"),
            "checkpoint": str(result.checkpoint.path) if result.checkpoint else None,
            "restored_from": m.get("restored_from"),
            "wall_s": round(time.time() - t0, 1),
            "loop_s": m.get("loop_s"),
            "trained_tokens": m.get("trained_tokens"),
        }
        tracker.metrics({"run/wall_s": out["wall_s"]}, int(m.get("steps") or 0))
        tracker.reward_curve(str(run_dir))
        return out
    finally:
        tracker.end(status)
        teardown(cfg, started)


def _graceful_stop(hub: Any) -> Any:
    """SIGTERM/SIGINT (Ctrl-C, `ray job stop`) during training: ask for a clean stop after the current step
    (final checkpoint, MLflow run and RESULT as usual); a second signal interrupts at once."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def handler(signum: int, frame: Any) -> None:
        if getattr(handler, "fired", False):
            raise KeyboardInterrupt(f"signal {signum} again: stopping now")
        handler.fired = True  # type: ignore[attr-defined]
        log.warning("signal %d: stopping cleanly after the current step (again to stop now)", signum)
        hub.request_stop.remote(f"signal {signal.Signals(signum).name}")

    for sig in previous:
        signal.signal(sig, handler)

    def restore() -> None:
        for sig, h in previous.items():
            signal.signal(sig, h)

    return restore


def teardown(cfg: DictConfig, started: bool) -> None:
    """Stop what this run started: the whole local cluster if it started one, else only its own parts."""
    import ray
    from ray import serve

    from app.rollouter import rollouter_name
    from app.serve_rollout import NAMESPACE, app_name, hub_name

    if started:
        try:
            serve.shutdown()
        except Exception as e:
            log.warning("serve shutdown: %s", e)
        ray.shutdown()
        return
    try:
        serve.delete(app_name(cfg.ray.name))
    except Exception as e:
        log.warning("deleting the rollout app: %s", e)
    for name in (hub_name(cfg.ray.name), rollouter_name(cfg.ray.name)):
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE))
        except ValueError:
            pass
        except Exception as e:
            log.warning("killing %s: %s", name, e)
