"""app/infra/log_filters.py: its filter of Ray's driver output (RAY_NOISE, always; RAY_CHATTER, unless
log_level=DEBUG): each known line of a clean run (copied from a `--config quick` log) is dropped by Ray's own log
deduplicator, and the errors that look like them still print; the libraries' levels by `log_level`; Ray Train's
cleaner-stop timeout demoted in its controller. No cluster starts: Ray's deduplicator is the code that filters
what the driver prints."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.infra import log_filters
from app.infra.log_filters import (
    RAY_CHATTER,
    RAY_NOISE,
    RAY_SKIP_ENV,
    configure_logging,
    quiet_ray_noise,
    ray_chatter_regex,
    ray_noise_regex,
)

REPO = Path(__file__).resolve().parents[1]

# lines of a clean `--config quick` run's log (Ray 2.60, vLLM 0.32), as Ray hands them to the driver
NOISE = [
    "Task ServeController.listen_for_change failed. There are infinite retries remaining, so the task will be "
    "retried. Error: The actor is dead because it was killed by `ray.kill`.",
    "Task ServeController.graceful_shutdown failed. There are infinite retries remaining, so the task will be "
    "retried. Error: The actor is dead because it was killed by `ray.kill`.",
    "INFO 2026-11-26 11:40:31,604 controller 21626 -- Removing 1 replica from Deployment(name='rollout', "
    "app='relay-rollout').",
    "INFO 2026-11-26 11:40:38,785 controller 21626 -- Replica(id='zvhu5voq', deployment='rollout', "
    "app='relay-rollout') is stopped.",
    "WARNING: 16 PYTHON worker processes have been started on node: 9534e77b916c9ed48bb1dc397860ce5bd6693e43fca0"
    "7317004dc833 with address: 192.0.2.2, which is 8x the maximum expected startup concurrency (2). This could "
    "be a result of using a large number of actors, or due to tasks blocked in ray.get() calls (see "
    "https://github.com/ray-project/ray/issues/3644 for some discussion of workarounds).",
    "WARNING 2026-11-26 10:02:11,122 placement_group_cleaner.py:93 -- Failed to query Ray Train Controller actor "
    "state. State API may be temporarily unavailable. Continuing to monitor.",
    "(EngineCore pid=22546) WARNING 11-26 11:40:38 [multiproc_executor.py:491] [shutdown] Executor: workers still "
    "running after grace period; sending SIGTERM count=1",
    "(MainProcess pid=21911) WARNING 11-26 11:40:38 [utils.py:648] [shutdown] Process manager: force killing "
    "remaining processes count=1",
    "(MainProcess pid=21911) WARNING 11-26 11:40:38 [utils.py:653] [shutdown] Process manager: force killing "
    "remaining process EngineCore pid 22546",
    "(MainProcess pid=21911) WARNING 11-26 11:40:38 [system_utils.py:225] [shutdown] force killing sub process "
    "VLLM::Worker pid 22955",
    "[rank0]:[W1126 10:03:01.123456789 ProcessGroupNCCL.cpp:1538] Warning: WARNING: destroy_process_group() was "
    "not called before program exit, which can leak resources. For more info, please see "
    "https://pytorch.org/docs/stable/distributed.html#shutdown (function operator())",
    "[2026-11-28 13:01:26,406 E 28312 28402] core_worker.cc:2465: Actor with class name: "
    "'MapWorker(MapBatches(Prepare))' and ID: '7e0819206665445421d6550501000000' has constructor arguments in "
    "the object store and max_restarts > 0. If the arguments in the object store go out of scope or are lost, "
    "the actor restart will fail. See https://github.com/ray-project/ray/issues/53727 for more details.",
    "[2026-11-28 13:01:28,797 E 28344 28413] core_worker.cc:2465: Actor with class name: 'PreemptionWatcher' "
    "and ID: '1ca2b05df2a6ef22a8bd6f9201000000' has constructor arguments in the object store and "
    "max_restarts > 0. If the arguments in the object store go out of scope or are lost, the actor restart "
    "will fail. See https://github.com/ray-project/ray/issues/53727 for more details.",
    "Progress bars disabled. To enable, set `ray.data.DataContext.get_current().enable_progress_bars = True`.",
    "(MainProcess pid=28313) WARNING 11-28 13:01:35 [vllm.py:1703] Enforce eager set, disabling torch.compile, "
    "CUDAGraphs, and JIT kernel warmup. This is equivalent to setting -cc.mode=none -cc.cudagraph_mode=none "
    "and --kernel_config.enable_jit_warmup=False",
    "(EngineCore pid=29165) WARNING 11-28 13:01:54 [vllm.py:1727] Inductor compilation was disabled by user "
    "settings, optimizations settings that are only active during inductor compilation will be ignored.",
    "(MainProcess pid=28313) WARNING 11-28 13:01:35 [cpu.py:224] Triton is not installed. triton-cpu is "
    "expected on x86 CPUs.",
    "(MainProcess pid=28313) WARNING 11-28 13:01:35 [cpu.py:317] Reset SSM cache type to float32 for "
    "accelerated GDN mamba backend 'none'.",
    "(EngineCore pid=29165) WARNING 11-28 13:01:52 [vllm.py:725] Model Runner V2 requires Triton; using the V1 "
    "model runner instead.",
    "Triton is installed, but doesn't include CPU backend. Disabling Triton.",
    "[W1128 13:01:52.750062642 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for memory allocation "
    "on the NUMA nodes (0). Memory allocations will be strictly bound to these NUMA nodes. (function "
    "init_cpu_memory_env)",
    "(MainProcess pid=28313) WARNING 11-28 13:01:56 [input_processor.py:408] Passing raw prompts to "
    "InputProcessor is deprecated and will be removed in the future. You should instead pass the outputs of "
    "Renderer.render_cmpl() or Renderer.render_chat().",
]
# what Ray's components say at INFO on every run: dropped unless log_level=DEBUG
CHATTER = [
    "INFO 2026-11-28 13:01:04,228 proxy 192.0.2.2 -- Proxy starting on node 29c0787a67ec1ac774dd990bd877afadd67e"
    "78fe778a70964dfa95d5 (HTTP port: 8000).",
    "INFO 2026-11-28 13:01:04,470 proxy 192.0.2.2 -- Got updated endpoints: {}.",
    "INFO 2026-11-28 13:01:04,601 controller 28170 -- Deploying new version of Deployment(name='rollout', "
    "app='relay-rollout') (initial target replicas: 1).",
    "INFO 2026-11-28 13:01:04,719 controller 28170 -- Adding 1 replica to Deployment(name='rollout', "
    "app='relay-rollout').",
    "INFO 2026-11-28 13:01:56,256 serve 28312 -- Started <ray.serve._private.router.SharedRouterLongPollClient "
    "object at 0x7f2055478290>.",
    "Starting execution of Dataset dataset_0355QzxPNOWmcgXHYBfjfB_0. Full logs are in "
    "/tmp/ray/session_2026-11-28_13-00-48_629206_26809/logs/ray-data",
    "Execution plan of Dataset dataset_0355R0OPpzeyhEaEbkdbYi_0: InputDataBuffer[Input] -> "
    "AllToAllOperator[Repartition]",
    "\u2714\ufe0f  Dataset dataset_0355QzxPNOWmcgXHYBfjfB_0 execution finished in 16.88 seconds",
    "Requesting resources: {'CPU': 1.0} * 2",
    "Attempting to start training worker group of size 2 with the following resources: [{'CPU': 1.0}] * 2",
    "Started training worker group of size 2: ",
    "- (ip=192.0.2.2, pid=28654) world_rank=0, local_rank=0, node_rank=0",
    "Setting up process group for: env:// [rank=0, world_size=2]",
    "Checkpoint successfully created at: Checkpoint(filesystem=local, path=/tmp/quietrun/relay-1/ray_train/"
    "relay-1/step_000004_1795870923819)",
    "Reporting training result 1: TrainingReport(checkpoint=Checkpoint(filesystem=local, path=/tmp/q/step_4), "
    "metrics={'weight_version': 4, 'steps': 4}, validation=False) from rank 0",
]
# what must still print: real failures that share words with the noise
KEPT = [
    "Task ServeController.listen_for_change failed. There are infinite retries remaining, so the task will be "
    "retried. Error: The actor died unexpectedly before finishing this task.",
    "Task Rollouter.progress failed. There are infinite retries remaining, so the task will be retried. Error: "
    "The actor is dead because it was killed by `ray.kill`.",
    "WARNING 2026-11-26 10:02:11,122 placement_group_cleaner.py:120 -- Failed to clean up placement group: boom",
    "WARNING 2026-11-26 11:38:34,986 controller 21626 -- Deployment 'rollout' in application 'relay-rollout' has "
    "1 replicas that have taken more than 30s to initialize.",
    "ERROR 2026-11-26 11:38:34,986 controller 21626 -- Exception in Replica(id='zvhu5voq', deployment='rollout', "
    "app='relay-rollout'), the replica will be stopped.",
    "(EngineCore pid=22546) ERROR 11-26 11:40:38 [core.py:1021] EngineCore encountered a fatal error.",
    "A worker died or was killed while executing a task by an unexpected system error.",
    "step 4: reward 0.406 loss -0.0000 gen 0.52s train 0.22s sync 0.290s staleness 0.00",
    "[2026-11-28 13:01:26,406 E 28312 28402] core_worker.cc:2465: Actor with class name: 'Rollouter' and ID: "
    "'7e0819206665445421d6550501000000' has constructor arguments in the object store and max_restarts > 0.",
    "(EngineCore pid=29165) WARNING 11-28 13:01:52 [cpu_worker.py:114] libtcmalloc is not found in LD_PRELOAD. "
    "For best performance, please follow the section `set LD_PRELOAD`.",
    "Triton is installed, but doesn't include CPU backend. Disabling Triton. Then it failed.",
    "ERROR 2026-11-28 13:01:04,719 controller 28170 -- Failed to update the deployments ['rollout'].",
    "WARNING 2026-11-28 13:01:04,719 proxy 192.0.2.2 -- Proxy on node x is unhealthy.",
    "Setting up the run: step 0",
    "- the rollouter: 3 prompts",
    "ray.exceptions.GetTimeoutError: Get timed out: some object(s) not ready.",
]


@pytest.fixture
def fresh(monkeypatch):
    """log_filters' state and the variables it sets as in a new process; the loggers it touches restored."""
    monkeypatch.setattr(log_filters, "_quiet", {"noise": False, "chatter": False})
    monkeypatch.setattr(log_filters, "_skip", {"theirs": "", "written": ""})
    monkeypatch.setattr(log_filters, "_user_env", {})
    for k in (RAY_SKIP_ENV, "PYTHONWARNINGS", log_filters.TRAIN_CALLBACKS_ENV, *log_filters.LIBRARY_ENV):
        monkeypatch.delenv(k, raising=False)
    names = (*log_filters.DRIVER_LOGGERS, log_filters.PG_CLEANER_LOGGER, log_filters.RESOURCE_REQUEST_LOGGER)
    loggers = [logging.getLogger(n) for n in names]
    saved = [(lg, list(lg.filters)) for lg in loggers]
    root_level = logging.getLogger().level
    yield
    for lg, filters in saved:
        lg.filters[:] = filters
    logging.getLogger().setLevel(root_level)


@pytest.mark.parametrize("line", NOISE)
def test_each_known_shutdown_line_is_matched(line):
    assert re.search(ray_noise_regex(), line), line


@pytest.mark.parametrize("line", CHATTER)
def test_each_known_info_line_is_matched(line):
    assert re.search(ray_chatter_regex(), line), line


@pytest.mark.parametrize("line", KEPT)
def test_real_errors_are_not_matched(line):
    assert not re.search(ray_noise_regex(), line), line
    assert not re.search(ray_chatter_regex(), line), line


def test_every_pattern_has_a_sample():
    for name, pattern in RAY_NOISE.items():
        assert any(re.search(pattern, ln) for ln in NOISE), f"{name}: no sample line"
    for name, pattern in RAY_CHATTER.items():
        assert any(re.search(pattern, ln) for ln in CHATTER), f"{name}: no sample line"


def test_a_users_own_regex_is_kept(fresh, monkeypatch):
    monkeypatch.setenv(RAY_SKIP_ENV, "my noise")
    quiet_ray_noise()
    quiet_ray_noise()  # idempotent
    value = os.environ[RAY_SKIP_ENV]
    assert value == f"my noise|{ray_noise_regex()}"
    assert re.search(value, "here is my noise") and re.search(value, NOISE[0])
    configure_logging("INFO")  # the chatter after it; at DEBUG gone again, the user's and the noise kept
    assert os.environ[RAY_SKIP_ENV] == f"my noise|{ray_noise_regex()}|{ray_chatter_regex()}"
    configure_logging("DEBUG")
    assert os.environ[RAY_SKIP_ENV] == f"my noise|{ray_noise_regex()}"
    monkeypatch.setenv(RAY_SKIP_ENV, "(unclosed")
    with pytest.raises(ValueError, match=f"{RAY_SKIP_ENV}='\\(unclosed' is not a regular expression"):
        quiet_ray_noise()


def test_libraries_are_at_warning_unless_debug(fresh, monkeypatch):
    """vLLM and MLflow get WARNING through their own variables (a user's value kept), the driver's Ray and
    Serve loggers drop INFO; at log_level=DEBUG all of it is undone."""
    monkeypatch.setenv("MLFLOW_LOGGING_LEVEL", "INFO")  # the user's
    serve = logging.getLogger("ray.serve")

    def shown(level: int) -> bool:
        return serve.filter(logging.LogRecord("ray.serve", level, __file__, 1, "m", None, None)) is not False

    assert configure_logging("info") == "INFO"
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING" and os.environ["MLFLOW_LOGGING_LEVEL"] == "INFO"
    assert not shown(logging.INFO) and shown(logging.WARNING)
    configure_logging("INFO")  # idempotent
    assert sum(isinstance(f, log_filters.BelowWarning) for f in serve.filters) == 1
    assert configure_logging("DEBUG") == "DEBUG" and logging.getLogger().level == logging.DEBUG
    assert "VLLM_LOGGING_LEVEL" not in os.environ and os.environ["MLFLOW_LOGGING_LEVEL"] == "INFO"
    assert shown(logging.INFO)


def test_the_cluster_ignores_vllms_reduce_op_warning_and_trains_with_the_callback(fresh, monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "error::DeprecationWarning")
    monkeypatch.setenv(log_filters.TRAIN_CALLBACKS_ENV, "my.Callback")
    quiet_ray_noise()
    quiet_ray_noise()  # idempotent
    assert os.environ["PYTHONWARNINGS"] == f"error::DeprecationWarning,{log_filters.VLLM_WARNING}"
    assert os.environ[log_filters.TRAIN_CALLBACKS_ENV] == f"my.Callback,{log_filters.TRAIN_CALLBACK}"


_WARNS = """
import warnings
g = {"__name__": "vllm.triton_utils.dispatcher"}  # where vLLM's CPU build reads torch.distributed.reduce_op
exec("import torch.distributed as d\\nhasattr(d.__dict__['reduce_op'], '__dict__')", g)
warnings.warn("`torch.distributed.reduce_op` is deprecated", FutureWarning)  # anywhere else: still shown
"""


def test_vllms_reduce_op_warning_is_ignored_in_a_new_process():
    env = {**os.environ, "PYTHONWARNINGS": log_filters.VLLM_WARNING}
    proc = subprocess.run(
        [sys.executable, "-c", _WARNS], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("FutureWarning") == 1 and "<string>:5" in proc.stderr, proc.stderr


def _cleaner_stop(
    exc: BaseException, message: str = "Failed to stop PlacementGroupCleaner gracefully."
) -> list:
    """The records Ray Train's console (INFO and above) shows for its cleaner-stop failure `exc`."""
    shown: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = shown.append  # type: ignore[method-assign]
    logger = logging.getLogger(log_filters.PG_CLEANER_LOGGER)
    logger.addHandler(handler)
    try:
        try:
            raise exc
        except BaseException:
            logger.exception(message)
    finally:
        logger.removeHandler(handler)
    return shown


def test_a_late_cleaner_stop_is_debug_and_other_failures_keep_their_level(fresh):
    from ray.exceptions import GetTimeoutError

    log_filters.quiet_train_controller()
    log_filters.quiet_train_controller()  # idempotent
    assert not _cleaner_stop(GetTimeoutError("Get timed out: some object(s) not ready."))
    [other] = _cleaner_stop(RuntimeError("boom"))
    assert other.levelno == logging.ERROR and other.exc_info is not None
    [elsewhere] = _cleaner_stop(GetTimeoutError("x"), "Failed to register placement group with cleaner")
    assert elsewhere.levelno == logging.ERROR


def test_a_late_resource_request_is_one_line_once_and_other_failures_keep_their_record(fresh):
    """The record as Ray Train 2.60 logs it (autoscaling_coordinator_client.send_resource_request)."""
    from ray.exceptions import GetTimeoutError

    log_filters.quiet_train_controller()
    log_filters.quiet_train_controller()  # idempotent
    logger = logging.getLogger(log_filters.RESOURCE_REQUEST_LOGGER)
    assert sum(isinstance(f, log_filters.ResourceRequestFilter) for f in logger.filters) == 1
    msg = (
        "Failed to send resource request for train-1. If this only happens transiently during network partition"
        " or CPU being overloaded, it's safe to ignore this error. If this error persists, file a GitHub issue."
    )
    shown: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = shown.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        for exc in (GetTimeoutError("Get timed out"), GetTimeoutError("Get timed out"), RuntimeError("boom")):
            try:
                raise exc
            except BaseException:
                logger.warning(msg, exc_info=True)
    finally:
        logger.removeHandler(handler)
    first, other = shown  # the second timeout went to DEBUG, below the console's INFO
    assert first.levelno == logging.WARNING and first.exc_info is None
    assert first.getMessage().startswith("Failed to send resource request for train-1. (late replies")
    assert "\n" not in first.getMessage()
    assert other.exc_info is not None and isinstance(other.exc_info[1], RuntimeError)


def test_the_controller_callback_installs_the_filters_as_it_is_unpickled(fresh):
    """Ray Train pickles its callbacks to the controller actor; the scaling policy's first resource request
    may come before any `after_controller_start` of ours, so the filters go in at unpickling."""
    import pickle

    from app.infra.train_log_callback import ControllerLogFilters

    for name in (log_filters.PG_CLEANER_LOGGER, log_filters.RESOURCE_REQUEST_LOGGER):
        logging.getLogger(name).filters[:] = []
    cb = pickle.loads(pickle.dumps(ControllerLogFilters()))
    assert isinstance(cb, ControllerLogFilters)
    for name, kind in (
        (log_filters.PG_CLEANER_LOGGER, log_filters.CleanerStopFilter),
        (log_filters.RESOURCE_REQUEST_LOGGER, log_filters.ResourceRequestFilter),
    ):
        assert [type(f) for f in logging.getLogger(name).filters] == [kind], name


def test_ray_train_builds_the_controller_callback_from_the_variable(fresh, monkeypatch):
    """Ray Train reads RAY_TRAIN_CALLBACKS (its name pinned here) where the trainer is built; the callback it
    makes installs the filter where the controller starts."""
    from ray.train.v2._internal.callbacks.env_callback import _initialize_env_callbacks
    from ray.train.v2._internal.constants import RAY_TRAIN_CALLBACKS_ENV_VAR

    assert RAY_TRAIN_CALLBACKS_ENV_VAR == log_filters.TRAIN_CALLBACKS_ENV
    quiet_ray_noise()
    [cb] = _initialize_env_callbacks()
    cb.after_controller_start(None)
    logger = logging.getLogger(log_filters.PG_CLEANER_LOGGER)
    assert any(isinstance(f, log_filters.CleanerStopFilter) for f in logger.filters)


_DRIVER = """
import json, sys
from app.infra.log_filters import configure_logging, quiet_ray_noise
configure_logging("INFO")  # as app/__main__.py, before Ray is imported
took = quiet_ray_noise()
configure_logging(sys.argv[1])  # the config's log_level
from ray._private import ray_logging
lines = json.loads(sys.stdin.read())
out = ray_logging.stdout_deduplicator.deduplicate({"lines": lines, "pid": "raylet", "ip": "x", "is_err": False})
print(json.dumps({"took": took, "printed": [ln for b in out for ln in b["lines"]]}))
"""


@pytest.mark.parametrize("level", ["INFO", "DEBUG"])
def test_rays_driver_drops_the_noise_and_prints_the_rest(level):
    """Ray reads the filter when it is imported: in a fresh process, as the CLI's driver, Ray's deduplicator
    (what prints the workers' and the raylet's lines) drops every NOISE line, every CHATTER line unless
    log_level=DEBUG, and passes every KEPT one."""
    env = {k: v for k, v in os.environ.items() if k not in (RAY_SKIP_ENV, "RAY_DEDUP_LOGS")}
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, level],
        input=json.dumps(NOISE + CHATTER + KEPT),
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["took"] is True
    assert got["printed"] == (CHATTER + KEPT if level == "DEBUG" else KEPT)


def test_each_push_is_one_debug_line(caplog):
    """A push's phases (`PushStats.summary`) are at DEBUG: the step line carries the push's time at INFO."""
    from app.sync import TrainerSync
    from app.weights.broadcast import BroadcastTransport
    from app.weights.records import PushStats

    ts = TrainerSync.__new__(TrainerSync)
    ts.cfg = SimpleNamespace(
        train=SimpleNamespace(timeout_s=60.0),
        sync=SimpleNamespace(timeout_s=10.0, broadcast=SimpleNamespace(bucket_mb=1)),
    )
    ts.walker, ts.rank, ts.senders, ts._late = BroadcastTransport(), 0, 1, None
    ts._plan = lambda version, nbytes: SimpleNamespace(version=version)
    ts._announce = lambda plan, deadline: (0.001, 0.002)
    ts._send = lambda plan: (PushStats(version=plan.version, nbytes=2**20, buckets=1), None)
    with caplog.at_level(logging.INFO, logger="app.train"):
        ts.push(3)
    assert not caplog.records
    with caplog.at_level(logging.DEBUG, logger="app.train"):
        ts.push(4)
    [rec] = caplog.records
    assert rec.levelno == logging.DEBUG and rec.getMessage().startswith("push v4: ")


def test_a_dead_engines_failed_requests_are_one_line_in_a_replicas_log():
    """Serve logs each failed request with its traceback: after an engine's death, the first EngineDeadError
    is one line, the rest are dropped; another failure keeps its record and traceback."""
    import logging

    from app.infra.log_filters import DeadEngineRequestFilter

    class EngineDeadError(RuntimeError):
        pass

    def record(exc: BaseException) -> logging.LogRecord:
        try:
            raise exc
        except BaseException:
            info = sys.exc_info()
        return logging.LogRecord("ray.serve", logging.ERROR, "replica.py", 1, "Request failed.", None, info)

    f = DeadEngineRequestFilter()
    wrapped = RuntimeError("task failed")
    wrapped.cause = EngineDeadError("engine died")  # as Ray's RayTaskError keeps it
    first, *rest = [record(EngineDeadError("engine died")), *(record(wrapped) for _ in range(200))]
    assert f.filter(first) and first.exc_info is None and "EngineDeadError" in first.getMessage()
    assert not any(f.filter(r) for r in rest) and f.dropped == 201
    other = record(ValueError("a bad request"))
    assert f.filter(other) and other.exc_info is not None
