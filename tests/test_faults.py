"""Faults a real cluster has, at unit level: a dead vLLM engine, and recovery bounded by deadlines."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace
from typing import Any

import pytest

from app.sync import ReplicaSync
from app.vllm import engine as vla
from app.weights.hub import WeightHub
from app.weights.records import Ack


class _Remote:
    """An object in this process called like a Ray actor handle (`handle.method.remote(...)`)."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def __getattr__(self, name: str) -> Any:
        return SimpleNamespace(remote=getattr(self.target, name))


class _Engine:
    """The parts of vLLM's AsyncLLM a replica's health check reads."""

    def __init__(self) -> None:
        self.errored = False

    async def collective_rpc(self, method: str, timeout: float | None = None, kwargs: Any = None) -> list:
        await asyncio.sleep(0.01)
        return [{}]

    async def check_health(self) -> None:
        if self.errored:
            raise RuntimeError("EngineDeadError")


def test_engine_adapter_reports_a_dead_engine():
    eng = _Engine()
    assert not vla.engine_dead(eng)
    asyncio.run(vla.check_health(eng))
    eng.errored = True
    assert vla.engine_dead(eng)
    try:
        asyncio.run(vla.check_health(eng))
    except RuntimeError as e:
        assert "EngineDeadError" in str(e)
    else:
        raise AssertionError("a dead engine passed the health check")


def test_dead_engine_fails_health_and_leaves_the_group_at_once():
    """The replica's health check fails (Serve replaces it), it is dropped from the weight group, and a
    push waiting for its acknowledgement stops waiting for it (no full sync.timeout_s)."""

    async def scenario() -> None:
        hub = WeightHub()
        eng = _Engine()
        sync = ReplicaSync(eng, "r1", hub=_Remote(hub), control=None, poll_s=0.1)
        sync.started = time.time()
        await hub.register("r2", 1)
        await sync.start(join_timeout_s=5)
        await sync.check_health()  # alive
        g = await hub.open_epoch("127.0.0.1", 1, "gloo", 5.0)
        await hub.ack("r2", "join", g.epoch, Ack(ok=True))
        await hub.ack("r2", "push", 3, Ack(ok=True))
        waiter = asyncio.create_task(hub.wait_acks("push", 3, 30.0))
        await asyncio.sleep(0.2)
        eng.errored = True  # the EngineCore process was killed
        t0 = time.monotonic()
        acks = await waiter
        assert time.monotonic() - t0 < 5, "the push kept waiting for a replica whose engine died"
        assert "r1" in acks.missing and not acks.complete
        assert hub.members["r1"].dropped == "its vLLM engine died" and hub.alive_ids() == ["r2"]
        try:
            await sync.check_health()
        except RuntimeError as e:
            assert "engine died" in str(e)
        else:
            raise AssertionError("a replica with a dead engine passed its health check")
        await asyncio.sleep(0.3)
        assert "r1" not in hub.members or not hub.members["r1"].alive  # it does not register again
        await sync.stop()

    asyncio.run(scenario())


def test_replica_stopped_after_its_engine_died_is_dropped_with_the_reason():
    """Serve stops a replica whose health check failed, and that stop can reach the hub before the
    replica's own drop did (its weights loop waits on a long poll): it is recorded as dropped because its
    engine died, never as a clean leave."""
    from app.sync import ENGINE_DIED

    async def scenario() -> None:
        hub = WeightHub()
        eng = _Engine()
        sync = ReplicaSync(eng, "r1", hub=_Remote(hub), control=None, poll_s=30.0)
        sync.started = time.time()
        await sync.start(join_timeout_s=5)
        assert hub.members["r1"].alive
        eng.errored = True  # the EngineCore process was killed; no check has run since
        await sync.stop()
        m = hub.members["r1"]
        assert not m.alive and m.dropped == ENGINE_DIED and not m.leaving, m

    asyncio.run(scenario())


def test_push_budget_fits_the_trainer_collective_timeout():
    """A push retries for a time, not a count; one more attempt after the budget still ends before the
    other trainer ranks' collective timeout (train.timeout_s + sync.timeout_s + 60)."""
    from app.sync import TrainerSync

    for train_t, sync_t in [(300.0, 60.0), (300.0, 20.0), (60.0, 60.0)]:
        ts = TrainerSync.__new__(TrainerSync)
        ts.cfg = SimpleNamespace(
            train=SimpleNamespace(timeout_s=train_t), sync=SimpleNamespace(timeout_s=sync_t)
        )
        budget = ts._budget_s()
        assert budget >= sync_t
        assert budget + 2 * sync_t <= train_t + sync_t + 60


def test_run_dir_outlives_a_ray_job(tmp_path, monkeypatch):
    """The default run_dir is absolute under the home directory; one inside Ray's temporary copy of a job's
    working directory is refused with the fix."""
    from app.config import load_config
    from app.infra.storage import RunDirError, resolve_run_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_run_dir(load_config(None, []).run_dir) == tmp_path / "relay-runs"
    copy = tmp_path / "ray/session_x/runtime_resources/working_dir_files/_ray_pkg_abc"
    copy.mkdir(parents=True)
    monkeypatch.chdir(copy)
    with pytest.raises(RunDirError, match="Ray deletes with the job.*run_dir=~/relay-runs"):
        resolve_run_dir("runs")
    assert resolve_run_dir(str(tmp_path / "keep")) == tmp_path / "keep"
    with pytest.raises(RunDirError, match="URI is not supported"):
        resolve_run_dir("s3://bucket/runs")


def test_sigint_and_sigterm_give_the_clean_stop_while_fit_runs():
    """`trainer.fit()` runs in a worker thread (Ray Train installs no SIGINT handler of its own there) while
    the main thread handles the signal: the run control is asked for a clean stop and fit's result returns."""
    import os
    import signal
    import threading

    from app.driver import fit_with_clean_stop

    for sig in (signal.SIGINT, signal.SIGTERM):
        asked: list[str] = []
        stopped = threading.Event()

        def request_stop(reason: str, asked: list[str] = asked, stopped: threading.Event = stopped) -> None:
            asked.append(reason)
            stopped.set()

        control = SimpleNamespace(request_stop=SimpleNamespace(remote=request_stop))

        def fit(sig: int = sig, stopped: threading.Event = stopped) -> str:
            assert threading.current_thread() is not threading.main_thread()
            os.kill(os.getpid(), sig)  # as a terminal (Ctrl-C) or `ray job stop` (SIGTERM) would
            assert stopped.wait(10), "the signal did not reach the clean-stop handler"
            return "finished after the current step"

        before = signal.getsignal(sig)
        assert fit_with_clean_stop(fit, control) == "finished after the current step"
        assert asked == [f"signal {signal.Signals(sig).name}"]
        assert signal.getsignal(sig) is before  # the handler is restored after the run


def test_a_failed_rollout_deployment_ends_the_run_while_fit_waits():
    """The replicas start beside the trainer: while `fit()` waits (for a replica that will never come), the
    main thread's watch raises Serve's failure, which ends the wait at once, signal handlers restored."""
    import signal
    import threading

    from app.driver import fit_with_clean_stop

    never = threading.Event()
    calls: list[float] = []

    def fit() -> str:
        never.wait(60)  # the trainer's wait for the first replica
        return "trained"

    def watch() -> None:
        calls.append(time.monotonic())
        if len(calls) == 3:
            raise RuntimeError("the rollout deployment 'x-rollout' failed to start: no model")

    control = SimpleNamespace(request_stop=SimpleNamespace(remote=lambda reason: None))
    before = signal.getsignal(signal.SIGINT)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="failed to start: no model"):
        fit_with_clean_stop(fit, control, watch)
    assert time.monotonic() - t0 < 10  # not the 60 s of the wait
    assert signal.getsignal(signal.SIGINT) is before
    never.set()


def test_rollout_start_watch_reports_a_failed_deployment(monkeypatch):
    """Serve's application status, as `serve.status()` gives it: DEPLOYING is waited on, DEPLOY_FAILED raises
    with Serve's message, RUNNING ends the watch (later replica failures are the weight hub's)."""
    from ray import serve

    from app.rollout.start_watch import RolloutStartWatch

    states = iter(["DEPLOYING", "DEPLOY_FAILED"])

    def status() -> SimpleNamespace:
        app = SimpleNamespace(status=next(states), message="replica constructor raised: bad model")
        return SimpleNamespace(applications={"r-rollout": app})

    monkeypatch.setattr(serve, "status", status)
    watch = RolloutStartWatch("r-rollout", every_s=0.0)
    watch()  # deploying: nothing to say
    with pytest.raises(RuntimeError, match="'r-rollout' failed to start: replica constructor raised"):
        watch()
    states = iter(["DEPLOYING", "RUNNING"])
    ok = RolloutStartWatch("r-rollout", every_s=0.0)
    ok.wait(30)  # GPU replicas: the driver waits for them before the trainer starts
    ok()  # running once: no more queries (the iterator would be exhausted)
    assert ok.running
    states = iter(["DEPLOYING"] * 1000)
    with pytest.raises(TimeoutError, match="did not start within rollout.join_timeout_s=1s"):
        RolloutStartWatch("r-rollout", every_s=0.0).wait(1)


def test_a_rollouter_that_fails_to_start_ends_the_run_with_its_own_error(monkeypatch):
    """The trainer starts while the rollouter reads the prompts: the watch raises the rollouter's error (a bad
    row's DataError), also when the trainer's workers failed first on the dead rollouter."""
    import ray
    from ray import serve

    from app.driver import fit_with_clean_stop
    from app.rollout.prompt_files import DataError
    from app.rollout.start_watch import RolloutStartWatch

    ready: list[str] = []
    bad = DataError("train.jsonl row 4100 (line 4101): missing key 'answer'")

    def wait(refs, num_returns, timeout):
        assert timeout == 0  # a poll, never a wait
        return [r for r in refs if r in ready], [r for r in refs if r not in ready]

    def get(ref):
        raise bad

    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "get", get)
    deploying = SimpleNamespace(status="DEPLOYING", message="")
    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(applications={"r-rollout": deploying}))
    watch = RolloutStartWatch("r-rollout", every_s=0.0)
    watch.expect("rollouter-progress", "the rollouter's start")
    watch()  # still reading: nothing to say
    ready.append("rollouter-progress")

    def fit() -> str:
        raise RuntimeError("Training failed due to worker errors: ActorDiedError")

    control = SimpleNamespace(request_stop=SimpleNamespace(remote=lambda reason: None))
    with pytest.raises(DataError, match="row 4100"):
        fit_with_clean_stop(fit, control, watch)


class EngineDeadError(RuntimeError):
    """Stands for vLLM's (a replica's requests raise it once its EngineCore process died)."""


def test_serve_generate_retries_dead_replicas_until_its_deadline():
    from app.rollout.serve_generate import ServeGenerate, retryable

    class Handle:
        def __init__(self, failures: list[BaseException]) -> None:
            self.failures, self.calls = failures, 0
            self.generate = SimpleNamespace(remote=self._generate)

        async def _generate(self, req: Any) -> str:
            self.calls += 1
            if self.failures:
                raise self.failures.pop(0)
            return "served by a live replica"

    from ray.exceptions import ActorDiedError, RayTaskError
    from ray.serve.exceptions import DeploymentUnavailableError

    wrapped = RayTaskError("generate", "traceback", EngineDeadError("engine died"))
    assert retryable(EngineDeadError()) and retryable(wrapped) and retryable(ActorDiedError())
    assert retryable(DeploymentUnavailableError("rollout")) and not retryable(ValueError("bad request"))
    # the dead replica's requests go elsewhere: served once a live replica answers
    h = Handle([EngineDeadError(), ActorDiedError(), wrapped])
    gen = ServeGenerate(h, deadline_s=30, backoff_s=0.01)
    assert asyncio.run(gen(None)) == "served by a live replica" and h.calls == 4
    assert gen.stats["rollout/replica_retries"] == 3
    # a request that is itself bad is not retried
    h = Handle([ValueError("prompt too long")])
    try:
        asyncio.run(ServeGenerate(h, deadline_s=30, backoff_s=0.01)(None))
    except ValueError:
        assert h.calls == 1
    # bounded by the deadline, not by a count of tries
    h = Handle([EngineDeadError() for _ in range(10_000)])
    t0 = time.monotonic()
    try:
        asyncio.run(ServeGenerate(h, deadline_s=1.0, backoff_s=0.05)(None))
    except RuntimeError as e:
        assert "failed for 1s" in str(e) and 0.5 < time.monotonic() - t0 < 1 + 10, e
    else:
        raise AssertionError("retried past its deadline")


def test_retries_are_logged_once_with_a_count(caplog):
    """An engine's death fails every request in flight: one warning for the outage, not one per request."""
    from app.rollout.serve_generate import RETRY_LOG_EVERY_S, RetryLog

    retries = RetryLog()
    with caplog.at_level(logging.WARNING, logger="app.rollout.serve_generate"):
        for i in range(300):
            retries.retried(100.0 + i * 0.01, EngineDeadError(), 0.5)
        retries.retried(100.0 + RETRY_LOG_EVERY_S + 3.0, EngineDeadError(), 0.5)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all(r.exc_info is None for r in caplog.records), lines
    assert lines[0].startswith("1 request(s) failed") and lines[1].startswith("300 request(s) failed"), lines


def test_no_progress_bar_when_tqdm_is_disabled(monkeypatch):
    """Where stderr is no terminal the driver sets TQDM_DISABLE: the trainer's bar must not reach the logs."""
    from app.infra import ray_compat

    monkeypatch.setenv("TQDM_DISABLE", "1")
    bar = ray_compat.progress_bar(total=3, desc="x")
    bar.update(1)
    bar.set_description("y")
    bar.close()
    assert type(bar).__name__ == "_NoBar"


def test_a_stale_ray_cluster_record_is_forgotten_and_a_live_one_kept(tmp_path):
    """Ray's `ray_current_cluster` record of a stopped `ray start` (its port answers no more) is removed, as
    `ray stop` would; a record of a live address, or none at all, is left alone."""
    import socket

    from app.infra.ray_compat import forget_stale_cluster_address

    record = tmp_path / "ray_current_cluster"
    assert forget_stale_cluster_address(str(record)) is None  # no record
    with socket.socket() as live:
        live.bind(("127.0.0.1", 0))
        live.listen()
        address = f"127.0.0.1:{live.getsockname()[1]}"
        record.write_text(address)
        assert forget_stale_cluster_address(str(record)) is None and record.read_text() == address
    record.write_text(address)  # the listener is closed: nothing answers there now
    assert forget_stale_cluster_address(str(record)) == address and not record.exists()


def test_serve_started_by_two_drivers_at_once_is_joined_not_failed():
    """Two runs started at once on a fresh cluster both create Serve's controller; the second's
    ActorAlreadyExistsError means "it exists now": the call is made again (under a deadline) and connects."""
    from ray.exceptions import ActorAlreadyExistsError

    from app.infra.ray_compat import while_serve_starts

    calls = []

    def deploy():
        calls.append(1)
        if len(calls) < 3:
            raise ActorAlreadyExistsError("Actor with name 'SERVE_CONTROLLER_ACTOR' already exists")
        return "deployed"

    assert while_serve_starts(deploy) == "deployed" and len(calls) == 3

    def never():
        raise ActorAlreadyExistsError("Actor with name 'SERVE_CONTROLLER_ACTOR' already exists")

    t0 = time.monotonic()
    with pytest.raises(ActorAlreadyExistsError):
        while_serve_starts(never, timeout_s=0.5)
    assert time.monotonic() - t0 < 5
