"""The driver: wires the roles of one run and returns its result.

    data     the prompt files (or the embedded task) -> rows; the rollouter streams them through Ray Data
    rollout  a Serve deployment of vLLM replicas; each registers with the weight hub
    train    a TorchTrainer whose workers run app/train_loop.py's loop (GRPO on FSDP2, weight pushes)
    track    one MLflow run: params and config here, metrics from trainer rank 0

Everything started here is stopped here, also when the run fails.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from app import preflight
from app import tasks as builtin_tasks
from app.config import ConfigError, data_files, to_container
from app.envs import env_kind
from app.infra import ray_compat
from app.model_check import check_model_type
from app.model_path import resolve_model_path
from app.rollout.prompt_files import Columns, PromptRow, check_file, load_rows, uid_prefix
from app.rollout.start_watch import RolloutStartWatch
from app.run_folder import RunFolder, open_run

log = logging.getLogger("app.driver")


@dataclass
class Inputs:
    """The model folder and the prompt files of each split (resolved paths; several files are mixed per
    data.train_weights). The rollouter reads the files itself (in Ray Data), so the driver never holds a
    dataset; `train_rows`/`val_rows` load them whole, for tools and tests."""

    model_path: str
    train: list[str]
    val: list[str]
    columns: Columns = field(default_factory=Columns)

    def _rows(self, files: list[str]) -> list[PromptRow]:
        return [
            r
            for i, f in enumerate(files)
            for r in load_rows(f, self.columns, uid_prefix=uid_prefix(i, len(files)))
        ]

    @property
    def train_rows(self) -> list[PromptRow]:
        return self._rows(self.train)

    @property
    def val_rows(self) -> list[PromptRow]:
        return self._rows(self.val)


def resolve_inputs(cfg: DictConfig) -> Inputs:
    """The model folder and the prompt files, building the embedded default where asked. The prompt files are
    checked first (their columns and first rows: app/rollout/prompt_files.py `check_file`), then the model is
    found (a folder, or a hub id from the HF cache or downloaded: app/model_path.py), all before Ray starts."""
    columns = Columns.from_cfg(cfg.data)
    specs = {"train": data_files(cfg.data.train), "val": data_files(cfg.data.val, "data.val")}
    for spec in (s for files in specs.values() for s in files if not s.startswith("builtin:")):
        check_file(spec, columns)  # missing, unknown format, columns, first rows: before the cluster starts

    def path(spec: str, split: str) -> str:
        if spec in builtin_tasks.TASKS:  # a built-in task's folder holds train.jsonl and val.jsonl
            return str(builtin_tasks.task_folder(spec, cfg.model.cache_dir, cfg.seed) / f"{split}.jsonl")
        return str(Path(spec).expanduser().resolve())

    train, val = ([path(f, split) for f in specs[split]] for split in ("train", "val"))
    model_path = cfg.model.path
    if model_path in builtin_tasks.MODELS:
        model_path = str(builtin_tasks.model_folder(model_path, cfg.model.cache_dir, cfg.seed))
    else:
        model_path = resolve_model_path(model_path)  # a folder (`~` expanded) or a hub id
    # an architecture transformers cannot load: refused here (a config that passed before: at once)
    check_model_type(model_path, cfg.model.path, builtin_tasks.cache_root(cfg.model.cache_dir) / "checked")
    check_context(cfg, model_path)
    if cfg.model.lora.rank > 0:  # an unknown target fails here, naming the model's linear layers
        from app.trainer.lora import check_model_targets, parse_targets

        check_model_targets(model_path, parse_targets(cfg.model.lora.targets))
    return Inputs(str(Path(model_path).resolve()), train, val, columns)


def check_context(cfg: DictConfig, model_path: str) -> None:
    """Refuse, before anything starts, a `rollout.max_model_len` over the model's positions (vLLM refuses it
    inside the replica's constructor, minutes in, where the reason is easy to lose)."""
    try:
        hf = json.loads(Path(model_path, "config.json").read_text())
    except (OSError, ValueError):
        return  # not readable here: vLLM says what it thinks
    positions = hf.get("max_position_embeddings")
    if isinstance(positions, int) and not hf.get("rope_scaling") and cfg.rollout.max_model_len > positions:
        raise ConfigError(
            f"rollout.max_model_len={cfg.rollout.max_model_len} is over the model's max_position_embeddings="
            f"{positions} ({model_path}/config.json): set rollout.max_model_len={positions} or less, or use a "
            "model with a longer context"
        )


def check_machine(cfg: DictConfig) -> None:
    """A run that will start a local Ray cluster (no `ray.address`, no RAY_ADDRESS) and asks for GPUs on a
    machine without one is refused in one line, before anything is built or started."""
    if cfg.ray.address or os.environ.get("RAY_ADDRESS"):
        return  # the cluster's GPUs count, not this machine's: app/infra/resources.py checks them
    from app.infra.resources import check_local_gpus, local_gpu_count

    check_local_gpus(cfg, local_gpu_count())


def start_ray(cfg: DictConfig) -> bool:
    """Connect to (or start) Ray; returns True if this call started a local cluster."""
    import ray

    from app.infra import import_path

    if ray.is_initialized():
        return False
    env = {"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", "RELAY_LOG_LEVEL": cfg.log_level}
    # Ray 2.60 leaves CUDA_VISIBLE_DEVICES alone for roles that asked for no GPU (they would see every GPU);
    # this makes it hide the GPUs from them (app/infra/resources.py also hides them per role)
    env["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"] = "1"
    if os.environ.get(
        "TQDM_DISABLE"
    ):  # no bars in logs (app/__main__.py), also on a remote cluster's workers
        env["TQDM_DISABLE"] = os.environ["TQDM_DISABLE"]
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS") or None
    # a user's own `app` in the working directory never shadows Relay's in a worker: app/infra/import_path.py
    job = ray_compat.job_config(import_path.worker_paths)
    if address:
        ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=True, job_config=job)
        return False
    # address="local": a new cluster even where /tmp/ray/ray_current_cluster names a stale one; a stale
    # record is dropped first, since Ray's address-less state queries (Ray Train's) would follow it
    if stale := ray_compat.forget_stale_cluster_address():
        log.info("forgot Ray's record of a stopped cluster at %s (as `ray stop` would)", stale)
    # one node that this run owns: no node is ever drained, so Ray Train's preemption watcher (an actor that
    # polls for draining nodes) has nothing to watch; one process fewer to start beside the roles
    env["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "0"
    ray.init(
        address="local",
        num_cpus=cfg.ray.num_cpus,
        runtime_env={"env_vars": env},
        log_to_driver=True,
        job_config=job,
    )
    return True


@dataclass
class Prepared:
    """What `prepare` checked and resolved before anything starts: the inputs, the run's identity (model,
    data, config) and the checkpoint a resume continues from."""

    inputs: Inputs
    identity: dict[str, Any]
    resume: str | None
    t0: float


def prepare(cfg: DictConfig, resume_with_new_data: bool = False) -> Prepared:
    """Every check of a run that needs no cluster: the roles' view of the config, the machine, the checkpoint
    of a resume (verified, and compared with this run's model and data: `resume_with_new_data` allows a
    change of data.train), the data files, the model and the user's rewards on the first row. Raises the
    user error that names the fix (the command line exits 2)."""
    from app.trainer import checkpoint, resume_check

    t0 = time.time()
    preflight.check(cfg)  # what only the roles know (registries, rewards, built-ins), before anything starts
    check_machine(cfg)
    picked = checkpoint.select(cfg.train.resume) if cfg.train.resume else None  # fails early, clearly
    inputs = resolve_inputs(cfg)
    if not cfg.env.name:  # an environment gives its episodes' rewards itself
        from app.rewards.check import check_on_first_row

        # a user reward that fails on real data fails here
        check_on_first_row(cfg.reward, inputs.train, inputs.columns)
    identity = resume_check.identity(to_container(cfg), inputs.model_path, inputs.train, inputs.val)
    if picked is not None:
        picked.warn()  # a damaged newer checkpoint skipped, or one written before manifests
        resume_check.check(picked.path, identity, resume_with_new_data)
    return Prepared(inputs, identity, str(picked.path) if picked is not None else None, t0)


def run(cfg: DictConfig, resume_with_new_data: bool = False) -> dict[str, Any]:
    """One training run: `prepare`, then `launch`. Returns the RESULT record; raises if the run failed."""
    return launch(cfg, prepare(cfg, resume_with_new_data))


def launch(cfg: DictConfig, prepared: Prepared) -> dict[str, Any]:
    """The run itself: its folder and MLflow run, Ray, the roles, the loop. Returns the RESULT record."""
    from app.names import app_name
    from app.rewards.by_source import name_rewards
    from app.trainer import resume_check

    inputs, resume, t0 = prepared.inputs, prepared.resume, prepared.t0
    rewards = name_rewards(cfg, inputs.train + inputs.val, inputs.columns)  # reward.fn=auto's picks, logged
    # a resume continues its run folder and MLflow run (app/run_folder.py)
    rec, started = open_run_beside_ray(cfg, lambda: open_run(cfg, resume))
    (rec.dir / resume_check.IDENTITY).write_text(json.dumps(prepared.identity))  # each checkpoint keeps one
    if rewards:
        rec.tracker.tags({"relay.rewards": json.dumps(rewards)})
    status = "FAILED"
    try:
        # the actor handles live as long as this frame: a named actor whose last handle is dropped is killed
        watch = RolloutStartWatch(app_name(cfg.ray.name))
        cfg, hub, control, _rollouter = start_roles(cfg, inputs, watch, own_cluster=started)
        trainer = _build_trainer(cfg, inputs, rec, resume)
        if started:  # the run's own cluster: nothing outlives it for the placement-group cleaner to remove
            trainer = ray_compat.without_pg_cleaner(trainer)
        result = _fit(trainer, hub, control, rec, t0, watch)
        out = _collect(result, rec, t0)
        status = "FINISHED"
        return out
    finally:
        rec.close(status)
        teardown(cfg, started)


def open_run_beside_ray(cfg: DictConfig, open_folder: Callable[[], RunFolder]) -> tuple[RunFolder, bool]:
    """The run folder (`open_folder()`, in a thread) and `start_ray(cfg)` (in this thread) at once: Ray's start
    mostly waits for its daemons, while MLflow's import and store take the CPU. Where either fails, what the
    other opened is closed (the folder FAILED, a cluster this call started stopped) and the error raised."""
    from concurrent.futures import ThreadPoolExecutor

    import ray

    with ThreadPoolExecutor(1, thread_name_prefix="relay-open-run") as pool:
        opening = pool.submit(open_folder)
        try:
            started = start_ray(cfg)
        except BaseException:
            with contextlib.suppress(Exception):
                opening.result().close("FAILED")
            raise
        try:
            return opening.result(), started
        except BaseException:
            if started:
                ray.shutdown()
            raise


def _plan_resources(cfg: DictConfig) -> DictConfig:
    """Resolve `resources.*` shares and `sync.transport=auto` against the cluster; refuse a plan that would
    wait forever or cannot work."""
    import ray

    from app.infra.resources import auto_transport, check_nccl_devices, check_nodes, check_placement
    from app.infra.resources import check as check_resources
    from app.infra.resources import resolve as resolve_resources

    cluster = ray.cluster_resources()
    shares = resolve_resources(cfg, cluster)  # resources.* shares -> per-role settings
    if shares:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"{k}={v}" for k, v in shares.items()]))
        log.info("resources.* on this cluster: %s", shares)
    need = check_resources(cfg, cluster)  # refuse a plan that would wait forever
    check_nodes(cfg, [n["Resources"] for n in ray.nodes() if n["Alive"]])  # and one pinned to nodes
    check_placement(cfg)  # refuse a placement that cannot work (a GPU vLLM build on CPU replicas)
    if cfg.sync.transport == "auto":  # CUDA IPC where trainer and replicas share the one GPU
        cfg = OmegaConf.merge(cfg, {"sync": {"transport": auto_transport(cfg, cluster)}})
        log.info("sync.transport=auto: %s", cfg.sync.transport)
    check_nccl_devices(cfg, cfg.sync.transport)
    log.info("resources by role: %s", need)
    return cfg


def start_roles(
    cfg: DictConfig, inputs: Inputs, watch: RolloutStartWatch, own_cluster: bool = False
) -> tuple[DictConfig, Any, Any, Any]:
    """The weight hub, the run control, the rollout deployment and the rollouter (both starting): the config
    with the resources resolved, and the hub's, the control's and the rollouter's handles.

    CPU replicas start while the rollouter reads the data and the trainer starts: the trainer's first push
    waits for the first replica (app/sync.py), its first batch for the rollouter (a call waits for the
    actor's start), and `watch` ends the run at once where the deployment or the rollouter fails to start
    (a bad data row: the DataError naming its file and row). GPU replicas start before the trainer (vLLM
    measures the free memory). On a cluster this run started (`own_cluster`), Serve runs without its HTTP
    proxy unless the env kind started it with one: the roles call the replicas through handles."""
    import ray

    from app.names import NAMESPACE, app_name, rollouter_name
    from app.rollout.rollouter import Rollouter
    from app.serve_rollout import build_app
    from app.weights.actors import start_sync_actors

    cfg = _plan_resources(cfg)
    hub, control = start_sync_actors(cfg.ray.name)  # the weight hub and the run control
    kind = env_kind(cfg.env.name)  # its services: the OpenAI endpoint that agent code drives rollouts through
    cfg = kind.before_serve(cfg)
    if own_cluster:
        ray_compat.start_serve_without_proxy()
    ray_compat.deploy_app(
        build_app(cfg, inputs.model_path),
        app_name(cfg.ray.name),
        external_scaler_enabled=cfg.rollout.scaling == "external",
    )
    kind.deploy(cfg, inputs.model_path)
    rollouter = (
        ray.remote(Rollouter)
        .options(name=rollouter_name(cfg.ray.name), namespace=NAMESPACE, num_cpus=0, max_concurrency=256)
        .remote(to_container(cfg), inputs.model_path, inputs.train, inputs.val)
    )
    ray.get(hub.status.remote(), timeout=300)
    watch.expect(rollouter.progress.remote(), "the rollouter's start (reading and tokenizing the prompts)")
    if cfg.rollout.replica_gpus > 0:  # vLLM sizes its KV cache from the GPU memory free at its start: the
        watch.wait(cfg.rollout.join_timeout_s)  # trainer comes after
    return cfg, hub, control, rollouter


def _build_trainer(cfg: DictConfig, inputs: Inputs, run: RunFolder, resume: str | None) -> Any:
    """The TorchTrainer whose workers run app/train_loop.py's loop."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from app.infra.resources import custom, trainer_env
    from app.train_loop import train_worker

    t = cfg.train
    return TorchTrainer(
        train_worker,
        train_loop_config={
            "cfg": to_container(cfg),
            "model_path": inputs.model_path,
            "run_id": run.tracker.run_id,
            "tracking_uri": run.uri,
            "run_dir": str(run.dir),
            "resume": resume,
        },
        scaling_config=ScalingConfig(
            num_workers=t.workers,
            use_gpu=t.use_gpu,
            resources_per_worker={
                "CPU": t.worker_cpus,
                **({"GPU": t.worker_gpus} if t.use_gpu else {}),
                **custom(cfg, "train"),  # resources.train_custom: pinned to the nodes that have them
            },
        ),
        torch_config=TorchConfig(
            backend=None if t.backend == "auto" else t.backend,
            # a push retries within train.timeout_s - 2 x sync.timeout_s (app/sync.py): it fits
            timeout_s=int(t.timeout_s + cfg.sync.timeout_s + 60),
        ),
        run_config=RunConfig(
            name=run.name,
            storage_path=str(run.dir / "ray_train"),
            checkpoint_config=CheckpointConfig(num_to_keep=t.keep_checkpoints),
            failure_config=FailureConfig(max_failures=t.max_failures),
            # a CPU trainer never touches a GPU (FSDP2 would otherwise move its parameters to cuda:0); a GPU
            # one gets train.cuda_alloc_conf
            worker_runtime_env={"env_vars": trainer_env(t)},
        ),
    )


def _fit(trainer: Any, hub: Any, control: Any, run: RunFolder, t0: float, watch: Callable[[], None]) -> Any:
    """`trainer.fit()` with the clean stop on SIGINT/SIGTERM; the weight group's membership history saved
    (who joined when, at which version, who left); a stall raises StallError with the watchdog's report."""
    import ray

    from app.infra.watchdog import REPORT as STALL_REPORT
    from app.infra.watchdog import StallError, summarize

    stall = run.dir / STALL_REPORT

    def stalled() -> bool:
        return stall.exists() and stall.stat().st_mtime >= t0

    try:
        result = fit_with_clean_stop(trainer.fit, control, watch)
    except Exception as e:  # Ray Train raises when the workers failed for good
        if stalled():
            raise StallError(summarize(json.loads(stall.read_text()))) from e
        raise
    finally:
        with contextlib.suppress(Exception):
            members = ray.get(hub.status.remote(), timeout=10)
            (run.dir / "rollout_members.json").write_text(json.dumps(members, indent=1))
            run.tracker.artifact(str(run.dir / "rollout_members.json"))
    if result.error:
        if stalled():
            raise StallError(summarize(json.loads(stall.read_text()))) from result.error
        raise result.error
    return result


def _collect(result: Any, run: RunFolder, t0: float) -> dict[str, Any]:
    """The RESULT record from the trainer's summary.json, with the run's wall time logged to MLflow."""
    summary = run.dir / "summary.json"
    if not summary.exists():
        raise RuntimeError(f"training ended without writing {summary}")
    m = json.loads(summary.read_text())
    out = {
        "run_id": run.tracker.run_id,
        "tracking_uri": run.uri,
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
    run.tracker.metrics({"run/wall_s": out["wall_s"]}, int(m.get("steps") or 0))
    run.tracker.reward_curve(str(run.dir))
    return out


def fit_with_clean_stop(fit: Callable[[], Any], control: Any, watch: Callable[[], None] | None = None) -> Any:
    """`fit()` in a worker thread while this (main) thread waits with the clean-stop handler installed, and
    calls `watch()` (which raises to end the run) every half second.

    Ray Train's `TorchTrainer.fit()` called from the main thread installs its own SIGINT handler (it aborts
    the run: exit 1, no RESULT); from another thread it installs none, so Ctrl-C, SIGTERM and `ray job stop`
    all reach `_graceful_stop`'s handler. The join has a timeout so the main thread runs signal handlers."""
    import threading

    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fit()
        except BaseException as e:  # handed to the main thread
            box["error"] = e

    worker = threading.Thread(target=target, name="relay-fit", daemon=True)
    restore = _graceful_stop(control)
    try:
        worker.start()
        while worker.is_alive():
            worker.join(timeout=0.5)
            if watch is not None:
                watch()
    finally:
        restore()
    if "error" in box:
        if watch is not None:
            watch()  # where a start failed (the rollouter's DataError), that is the news, not the workers' error
        raise box["error"]
    return box["result"]


def _graceful_stop(control: Any) -> Any:
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
        control.request_stop.remote(f"signal {signal.Signals(signum).name}")

    for sig in previous:
        signal.signal(sig, handler)

    def restore() -> None:
        for sig, h in previous.items():
            signal.signal(sig, h)

    return restore


def teardown(cfg: DictConfig, started: bool) -> None:
    """Stop what this run started: its actors and Serve apps, then the whole local cluster if it started one.

    The order keeps a clean run's end quiet (app/infra/log_filters.py): the rollouter, whose Serve handle
    long-polls Serve's controller, goes first; then the apps (their replicas leave the weight hub, which
    still runs, and end their vLLM engines); then the hub and the control. A local cluster then stops with
    `ray.shutdown()`: `serve.shutdown()` would add nothing but its own call on the controller, which fails
    (and is reported) when the controller ends itself."""
    import ray

    from app.names import control_name, hub_name, rollouter_name

    _kill_actors([rollouter_name(cfg.ray.name)])
    # a next run on these GPUs needs their memory back, and a local cluster's replicas must end their vLLM
    # engines before it stops; CPU replicas on a shared cluster stop without anyone waiting
    _delete_apps(cfg, wait=started or cfg.rollout.replica_gpus > 0)
    _kill_actors([hub_name(cfg.ray.name), control_name(cfg.ray.name)])
    if started:
        ray.shutdown()


def _delete_apps(cfg: DictConfig, wait: bool) -> None:
    """Delete this run's Serve apps: the env kind's services (the OpenAI endpoint), then the rollout
    deployment they call."""
    from app.names import app_name

    try:
        env_kind(cfg.env.name).teardown(cfg)
    except Exception as e:
        log.warning("removing the services of env.name=%s: %s", cfg.env.name, e)
    try:  # Serve's own deadline: 60 s for a blocking delete
        ray_compat.delete_app(app_name(cfg.ray.name), wait=wait)
    except Exception as e:
        log.warning("deleting the rollout app: %s", e)


def _kill_actors(names: list[str]) -> None:
    """Kill this run's named actors (those that exist)."""
    import ray

    from app.names import NAMESPACE

    for name in names:
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE))
        except ValueError:
            pass
        except Exception as e:
            log.warning("killing %s: %s", name, e)
