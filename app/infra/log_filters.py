"""Logging set-up shared by the driver and every role, and filters for known-harmless third-party output.

`configure_logging(level)` gives a process Relay's log format at `log_level` (the config key; Ray workers get
it as RELAY_LOG_LEVEL from the driver's runtime env, so a role calls `configure_logging()` bare) and puts the
libraries Relay runs at WARNING unless `log_level=DEBUG` (`quiet_libraries`): vLLM and MLflow through their own
switches (LIBRARY_ENV, read where each is imported: in the driver, and in the processes of a local cluster,
which inherit the driver's environment), the driver's own Ray and Serve loggers (DRIVER_LOGGERS: "Started a
local Ray instance", "Started Serve"), and what Ray's components narrate from the workers (RAY_CHATTER, below).

`silence_vllm_reload_warnings()` runs inside the vLLM worker process (where the worker extension is imported):
on every weight push vLLM's layer-wise reload warns "RotaryEmbedding: Failed to load weights" once per
model. A rotary embedding holds only `cos_sin_cache`, a non-persistent buffer computed from the model config,
so no checkpoint or push contains it; vLLM then puts the layer's own tensors back (reload/layerwise.py,
`finalize_layerwise_reload`), which is exactly right. Only that layer type is silenced: the same warning for
any other layer means weights really went missing and still shows.

`quiet_ray_noise()` runs in the driver before Ray is imported: it gives Ray's documented log filter
(`RAY_DEDUP_LOGS_SKIP_REGEX`, read once when Ray is imported, applied where the driver prints its workers' and
the raylet's lines) the lines that Ray, Serve, Ray Train and vLLM print on every clean run and that read as
failures (RAY_NOISE, each with why it is harmless); `configure_logging` adds the INFO lines of Ray's
components (RAY_CHATTER: Serve's controller and proxy, Ray Data's executions, Ray Train's worker group and
reports) unless `log_level=DEBUG`. A user's own RAY_DEDUP_LOGS_SKIP_REGEX is kept beside them;
RAY_DEDUP_LOGS=0 (Ray's switch) prints every line again. It also ignores one FutureWarning that vLLM's CPU
build raises in its own code (VLLM_WARNING, through PYTHONWARNINGS), and has Ray Train install
`CleanerStopFilter` in its controller (app/infra/train_log_callback.py, through RAY_TRAIN_CALLBACKS). The
causes Relay controls are fixed where they arise instead: the driver stops the actors that hold Serve
handles before Serve's apps, deletes the apps before the cluster stops (no `serve.shutdown()`, whose own call
dies with the controller), and the trainer destroys its process group at a clean end (app/driver.py
`teardown`, app/train_loop.py `train_worker`).

Imports nothing heavy (no torch, Ray or vLLM).
"""

from __future__ import annotations

import logging
import os
import re
import sys

from app.errors import raised_as

ENV = "RELAY_LOG_LEVEL"
FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
VLLM_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
RAY_SKIP_ENV = "RAY_DEDUP_LOGS_SKIP_REGEX"
# Lines of a clean run that say nothing is wrong. Each pattern is as narrow as the message allows.
RAY_NOISE: dict[str, str] = {
    # Serve's controller kills itself at the end of its graceful shutdown while a caller's call on it (the
    # shutdown request itself, a handle's long poll) is pending; the core worker reports the dead call
    "serve-controller-killed": r"Task ServeController\.\w+ failed\. There are infinite retries remaining, so "
    r"the task will be retried\. Error: The actor is dead because it was killed by `ray\.kill`",
    # Serve's controller narrating a replica's stop (Relay's weight hub logs a replica that leaves)
    "serve-replica-stop": r"controller \d+ -- (Removing \d+ replicas? from Deployment\(|Replica\(id='[^']*', "
    r"deployment='[^']*', app='[^']*'\) is stopped\.)",
    # the raylet counts started worker processes against min(cores, num_cpus): on a 2-core machine every run
    # with Serve, Train and Data actors passes it (a hint about start-up load, not a failure)
    "raylet-startup-concurrency": r"WARNING: \d+ PYTHON worker processes have been started on node: \S+ with "
    r"address: \S+, which is \d+x the maximum expected startup concurrency",
    # Ray Train's placement-group cleaner (a safety net for a controller that dies without cleaning up)
    # polls the dashboard's state API every second and warns on each failed poll
    "train-pg-cleaner": r"Failed to query Ray Train Controller actor state\. State API may be temporarily "
    r"unavailable\. Continuing to monitor\.",
    # vLLM's engine shutdown inside a stopping replica: worker processes still exiting after its grace period
    # are ended by vLLM itself
    "vllm-shutdown": r"\[shutdown\] (Executor: workers still running after grace period; sending SIGTERM|"
    r"Process manager: force killing remaining process|force killing sub process VLLM::)",
    # an NCCL process group of a process that exits (the weight group's side groups on GPUs)
    "nccl-destroy": r"WARNING: destroy_process_group\(\) was not called before program exit",
    # Ray's core worker on Ray Data's map actors (the rollouter's prompt preparation) and Ray Train's
    # preemption watcher, which their owners create with restarts: a restart that could not find its
    # arguments would fail with its own error then
    "actor-restart-args": r"Actor with class name: '(MapWorker\(MapBatches\(\w+\)\)|PreemptionWatcher)' and "
    r"ID: '[0-9a-f]+' has constructor arguments in the object store and max_restarts > 0",
    # Relay turns Ray Data's progress bars off where TQDM_DISABLE is set (app/infra/ray_compat.py)
    "ray-data-bars-off": r"Progress bars disabled\. To enable, set `ray\.data\.DataContext\.get_current\(\)\."
    r"enable_progress_bars = True`",
    # vLLM confirming the eager mode Relay asks for (weights load in place: create_engine, app/vllm/engine.py)
    "vllm-eager": r"(Enforce eager set, disabling torch\.compile, CUDAGraphs|Inductor compilation was "
    r"disabled by user settings, optimizations settings that are only active during inductor)",
    # vLLM's CPU build on a machine without Triton's CPU backend: it runs without Triton (the CPU replica)
    "vllm-cpu-triton": r"(^Triton is installed, but doesn't include CPU backend\. Disabling Triton\.$|"
    r"Triton is not installed\. triton-cpu is expected on x86 CPUs|Model Runner V2 requires Triton; using "
    r"the V1 model runner instead|Reset SSM cache type to float32 for accelerated GDN mamba backend 'none')",
    # torch binding a CPU engine's memory to the node's NUMA nodes (vLLM's CPU worker asks for it)
    "torch-numa-bind": r"Warning: NUMA binding: Using MEMBIND policy for memory allocation on the NUMA nodes",
    # Relay hands vLLM token ids (app/vllm/engine.py `generate`); the pinned vLLM renders them itself, once
    "vllm-raw-prompts": r"Passing raw prompts to InputProcessor is deprecated and will be removed in the future",
}
# What Ray's components narrate at INFO on every run (dropped unless log_level=DEBUG: `configure_logging`).
RAY_CHATTER: dict[str, str] = {
    # Serve's controller, proxies and handles (a replica's own lines are its deployment's)
    "serve-info": r"^INFO \d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (controller|proxy|serve) \S+ -- ",
    # Ray Data's executions (the rollouter's prompt reading, shuffles)
    "ray-data-info": r"^(Starting execution of Dataset \S+\. Full logs are in |Execution plan of Dataset \S+: |"
    r"\u2714\ufe0f? +Dataset \S+ execution finished in [\d.]+ seconds$)",
    # Ray Train's controller starting the worker group, its workers' process group, reports and checkpoints
    "train-info": r"^(Requesting resources: \{|Attempting to start training worker group of size \d+ with |"
    r"Started training worker group of size \d+: ?$|- \(ip=\S+, pid=\d+\) world_rank=\d+, local_rank=\d+, "
    r"node_rank=\d+$|Setting up process group for: \S+ \[rank=\d+, world_size=\d+\]|Checkpoint successfully "
    r"created at: Checkpoint\(|Reporting training result \d+: TrainingReport\()",
}
# the libraries' own level switches, read when each is imported (a value the user set is kept)
LIBRARY_ENV: dict[str, str] = {"VLLM_LOGGING_LEVEL": "WARNING", "MLFLOW_LOGGING_LEVEL": "WARNING"}
# the driver's loggers of Ray's start and Serve's (Serve sets its logger's level when imported: a filter stays)
DRIVER_LOGGERS = ("ray._private.worker", "ray.serve")
# vLLM's CPU build reads every module's attributes at start (triton_utils/dispatcher.py), torch.distributed's
# deprecated `reduce_op` among them: one FutureWarning a process, nothing Relay calls
VLLM_WARNING = "ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning:vllm.triton_utils.dispatcher"
TRAIN_CALLBACKS_ENV = (
    "RAY_TRAIN_CALLBACKS"  # Ray Train's callbacks by import path, read when a trainer is built
)
TRAIN_CALLBACK = "app.infra.train_log_callback.ControllerLogFilters"
PG_CLEANER_LOGGER = "ray.train.v2._internal.callbacks.placement_group_callback"
RESOURCE_REQUEST_LOGGER = "ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client"

_quiet = {"noise": False, "chatter": False}  # which of RAY_NOISE, RAY_CHATTER Ray's filter holds
_skip = {"theirs": "", "written": ""}  # the user's RAY_SKIP_ENV, and the value this module last wrote
_user_env: dict[str, str | None] = {}  # LIBRARY_ENV's values before this module first set them


def configure_logging(level: str | None = None) -> str:
    """Relay's format on the root logger at `level` (default: $RELAY_LOG_LEVEL, else INFO), the libraries at
    WARNING unless it is DEBUG (`quiet_libraries`); returns the level.

    Safe to call again (the driver does once the config is read): the handler is added once, the level reset.
    """
    name = (level or os.environ.get(ENV) or "INFO").upper()
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(format=FORMAT)
    root.setLevel(name)
    quiet_libraries(name != "DEBUG")
    return name


class BelowWarning(logging.Filter):
    """Drops a logger's records under WARNING (on a logger whose library sets its level itself)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


def quiet_libraries(quiet: bool) -> None:
    """With `quiet`, LIBRARY_ENV's variables (where the user set none), DRIVER_LOGGERS and RAY_CHATTER put
    the libraries at WARNING; without it (log_level=DEBUG) each is back at its own level. Each library reads
    its switch when it is imported (Ray its filter, in the driver)."""
    for k, v in LIBRARY_ENV.items():
        if _user_env.setdefault(k, os.environ.get(k)) is not None:
            continue
        if quiet:
            os.environ[k] = v
        else:
            os.environ.pop(k, None)
    for name in DRIVER_LOGGERS:
        logger = logging.getLogger(name)
        ours = [f for f in logger.filters if isinstance(f, BelowWarning)]
        if quiet and not ours:
            logger.addFilter(BelowWarning())
        for f in ours if not quiet else []:
            logger.removeFilter(f)
    _quiet["chatter"] = quiet
    _write_ray_skip()


class RotaryReloadFilter(logging.Filter):
    """Drops vLLM's "<...>RotaryEmbedding: Failed to load weights" (expected on every push, see module doc)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (
            msg.endswith(": Failed to load weights") and msg.split(":", 1)[0].endswith("RotaryEmbedding")
        )


def silence_vllm_reload_warnings() -> None:
    """Install RotaryReloadFilter on vLLM's reload logger (idempotent; before or after vLLM is imported)."""
    logger = logging.getLogger(VLLM_RELOAD_LOGGER)
    if not any(isinstance(f, RotaryReloadFilter) for f in logger.filters):
        logger.addFilter(RotaryReloadFilter())


class CleanerStopFilter(logging.Filter):
    """Ray Train's controller stops its placement-group cleaner at the run's end within 12 s, while the
    cleaner may be inside a state-API query of up to 10 s; on a loaded machine the stop outlasts that, and Ray
    Train logs "Failed to stop PlacementGroupCleaner gracefully." with the GetTimeoutError's traceback. The
    cleaner is a detached safety net: left running, it next sees the controller gone and the placement group
    removed by the controller's own shutdown, and exits. That record goes to DEBUG (Ray Train's system log
    keeps it, the console does not); any other failure of the stop keeps its level."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if type(exc).__name__ == "GetTimeoutError" and record.getMessage().startswith(
            "Failed to stop PlacementGroupCleaner"
        ):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


class ResourceRequestFilter(logging.Filter):
    """Ray Train's controller registers its workers' resources with Ray's autoscaling coordinator every few
    seconds, under a short `ray.get` deadline; on a loaded machine a reply comes late and Ray Train logs "Failed
    to send resource request ... safe to ignore" with the GetTimeoutError's 17-line traceback each time. The run
    is unaffected (the coordinator serves autoscaling only; the next request is sent again). The first such
    record is kept as one line, later ones go to DEBUG; any other failure keeps its record."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        text = record.getMessage()
        if type(exc).__name__ != "GetTimeoutError" or not text.startswith("Failed to send resource request"):
            return True
        self.seen += 1
        first = text.split(" If this", 1)[0]
        record.exc_info, record.exc_text = None, None
        record.msg = "%s (late replies from the autoscaling coordinator on a loaded machine; harmless)"
        record.args = (first,)
        if self.seen > 1:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


SERVE_LOGGER = "ray.serve"


class DeadEngineRequestFilter(logging.Filter):
    """In a rollout replica: Serve logs every request that raised ("Request failed.") with its traceback. When
    the replica's vLLM engine dies, every request in flight and every one routed to it before Serve's health
    check replaces it raises EngineDeadError (the rollouter retries each on a live replica): one traceback
    each made an engine kill's log hundreds of kB. The first such record is kept as one line, the rest are
    dropped; any other failure keeps its record."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if (
            exc is None
            or not record.getMessage().startswith("Request failed")
            or not raised_as(exc, {"EngineDeadError"})
        ):
            return True
        if self.dropped == 0:
            record.msg = (
                "Request failed: %s (its vLLM engine died); the rollouter retries such requests on live "
                "replicas, and further ones are not logged"
            )
            record.args = (type(exc).__name__,)
            record.exc_info, record.exc_text = None, None
        self.dropped += 1
        return self.dropped == 1


def quiet_dead_engine_requests() -> None:
    """Install DeadEngineRequestFilter on Serve's logger (in a replica process; idempotent)."""
    logger = logging.getLogger(SERVE_LOGGER)
    if not any(isinstance(f, DeadEngineRequestFilter) for f in logger.filters):
        logger.addFilter(DeadEngineRequestFilter())


def quiet_train_controller() -> None:
    """Install CleanerStopFilter and ResourceRequestFilter on Ray Train's loggers (in the controller process;
    idempotent)."""
    for name, kind in (
        (PG_CLEANER_LOGGER, CleanerStopFilter),
        (RESOURCE_REQUEST_LOGGER, ResourceRequestFilter),
    ):
        logger = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in logger.filters):
            logger.addFilter(kind())


def ray_noise_regex() -> str:
    """One regex that matches any RAY_NOISE line."""
    return "|".join(f"(?:{p})" for p in RAY_NOISE.values())


def ray_chatter_regex() -> str:
    """One regex that matches any RAY_CHATTER line."""
    return "|".join(f"(?:{p})" for p in RAY_CHATTER.values())


def _write_ray_skip() -> None:
    """RAY_SKIP_ENV: the user's own regex, then RAY_NOISE's (once `quiet_ray_noise` ran) and RAY_CHATTER's
    (while quiet). A value this module did not write is the user's. Ray reads it when it is imported."""
    current = os.environ.get(RAY_SKIP_ENV, "")
    if current != _skip["written"]:
        _skip["theirs"] = current
    parts = [_skip["theirs"]]
    parts += [ray_noise_regex()] if _quiet["noise"] else []
    parts += [ray_chatter_regex()] if _quiet["chatter"] else []
    value = "|".join(p for p in parts if p)
    if value:
        os.environ[RAY_SKIP_ENV] = value
    else:
        os.environ.pop(RAY_SKIP_ENV, None)
    _skip["written"] = value


def _append_env(name: str, item: str, sep: str) -> None:
    """Add `item` to the `sep`-separated list in env `name` (kept: what is there)."""
    current = os.environ.get(name, "")
    if item not in current.split(sep):
        os.environ[name] = f"{current}{sep}{item}" if current else item


def quiet_ray_noise() -> bool:
    """Have Ray's driver drop the RAY_NOISE lines, ignore VLLM_WARNING in the cluster's processes, and Ray
    Train's controller demote a cleaner that stopped late (see module doc); call before Ray is imported.
    Returns False where Ray was imported already (the filter is then as Ray read it at import)."""
    theirs = os.environ.get(RAY_SKIP_ENV, "")
    if theirs and theirs != _skip["written"]:
        try:  # Ray would fail on it at import, naming neither the variable nor the fix
            re.compile(theirs)
        except re.error as e:
            raise ValueError(
                f"{RAY_SKIP_ENV}={theirs!r} is not a regular expression ({e}): correct it or unset it"
            ) from e
    _quiet["noise"] = True
    _write_ray_skip()
    _append_env("PYTHONWARNINGS", VLLM_WARNING, ",")
    _append_env(TRAIN_CALLBACKS_ENV, TRAIN_CALLBACK, ",")
    return "ray" not in sys.modules
