"""app/infra/tracking.py without Ray: the background writer against a real SQLite store, against an HTTP server
that dies (calls return at once, drops counted) and against a real `mlflow server` SIGKILLed mid-run, name
sanitising, the start probe, concurrent store creation; the final model copied or referenced
(`tracking.log_model`) and registered; a run reopened; TensorBoard and W&B sinks fed by the same calls."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from app.infra import tracking, tracking_store
from app.infra.tracking import METRICS_FILE, MetricNames, Tracker, safe_metric_name
from app.infra.tracking_store import TrackingError, check_reachable

REPO = Path(__file__).resolve().parents[1]


def _sqlite(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _FakeMlflow:
    """A tiny HTTP server that answers `{}` to every request (enough for MLflow's log-batch) and records
    the requests; `stop()` kills it, `start()` brings it back on the same port."""

    def __init__(self) -> None:
        self.got: list[tuple[str, bytes]] = []
        self.port = 0
        self.start()

    def start(self) -> None:
        got = self.got

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                got.append((self.path, body))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def batches(self) -> list[dict]:
        return [json.loads(b) for p, b in self.got if p.endswith("runs/log-batch") and b]


def _wait(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


@pytest.mark.parametrize(
    "name",
    [
        "reward/sub/acc(strict)",
        "pass@k",
        "a//b",
        "/lead",
        "trail/",
        "../up",
        "x/./y",
        "..",
        "über",
        "",
        "q" * 300,
        "tab\tand\nnewline",
    ],
)
def test_safe_metric_name_is_accepted_by_mlflow(name):
    from mlflow.utils.validation import _validate_metric_name

    safe = safe_metric_name(name)
    _validate_metric_name(safe)  # raises where MLflow would refuse it
    assert len(safe) <= 250 and safe


def test_safe_names_stay_unchanged_and_renames_stay_distinct(caplog):
    for ok in ("loss/policy", "reward/mean", "sync/time_s", "val/reward", "a-b.c d:e"):
        assert safe_metric_name(ok) == ok
    names = MetricNames()
    with caplog.at_level(logging.WARNING, logger="app.infra.tracking"):
        a = names("acc(strict)")
        b = names("acc_strict_")
        again = names("acc(strict)")
    assert a == ("acc_strict_", True) and again == ("acc_strict_", False)
    assert b[0] != "acc_strict_"  # a different original never shares the logged name
    assert names.renamed == {"acc(strict)": "acc_strict_", "acc_strict_": "acc_strict__2"}
    assert sum("acc(strict)" in r.message for r in caplog.records) == 1  # warned once


def test_tracker_writes_to_sqlite_in_the_background(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = _sqlite(tmp_path)
    t = Tracker.start(uri, "exp", "run-a", {"train.lr": 1e-3}, jsonl=tmp_path / METRICS_FILE)
    t.metrics({"reward/sub/acc(strict)": 0.5, "loss": 2.0, "skip": math.nan, "text": "x"}, 1)  # type: ignore[dict-item]
    t.metrics({"reward/sub/acc(strict)": 0.75, "loss": 1.0}, 2)
    t.text("hello", "notes/hello.txt")
    assert t.end("FINISHED")
    run = MlflowClient(uri).get_run(t.run_id)
    assert run.info.status == "FINISHED" and run.data.params["train.lr"] == "0.001"
    assert run.data.metrics == {"reward/sub/acc_strict_": 0.75, "loss": 1.0}
    assert json.loads(run.data.tags["relay.renamed_metrics"]) == {
        "reward/sub/acc(strict)": "reward/sub/acc_strict_"
    }
    assert [m.step for m in MlflowClient(uri).get_metric_history(t.run_id, "loss")] == [1, 2]
    assert t.writer.dropped == 0
    lines = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert [{k: v for k, v in line.items() if k != "time"} for line in lines] == [
        {"step": 1, "reward/sub/acc(strict)": 0.5, "loss": 2.0},
        {"step": 2, "reward/sub/acc(strict)": 0.75, "loss": 1.0},
    ]
    assert all(line["time"] > 1e9 for line in lines)


def test_metrics_of_a_fast_loop_share_one_log_batch_and_close_does_not_wait_out_the_linger(tmp_path):
    """Steps that log within METRICS_LINGER_S of each other go to MLflow in one `log_batch` (one SQLite
    commit), each value at its own step; a call after the flush started goes in the next one; `close`
    writes what lingers at once."""
    from mlflow.tracking import MlflowClient

    uri = _sqlite(tmp_path)
    t = Tracker.start(uri, "exp", "run-linger", {})
    batches: list[list[int]] = []
    log_batch = t.client.log_batch

    def counting(run_id, metrics=(), **kw):
        if metrics:
            batches.append(sorted({m.step for m in metrics}))
        return log_batch(run_id, metrics=metrics, **kw)

    t.client.log_batch = counting  # type: ignore[method-assign]
    for step in (1, 2, 3):
        t.metrics({"loss": float(step), "reward/mean": step / 10}, step)
    assert t.writer.wait(lambda: t.writer.pending() == 0, timeout_s=30, give_up_s=30)
    assert batches == [[1, 2, 3]]
    t.metrics({"loss": 4.0}, 4)
    t0 = time.monotonic()
    assert t.close(timeout_s=30)
    assert time.monotonic() - t0 < tracking.METRICS_LINGER_S  # the last call did not linger
    assert batches == [[1, 2, 3], [4]]
    t.metrics({"loss": 5.0}, 5)  # after the end: dropped and counted, never left waiting
    assert batches == [[1, 2, 3], [4]] and t.writer.dropped == 1 and t._buffer.count() == 0
    history = MlflowClient(uri).get_metric_history(t.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]


def test_one_refused_metric_drops_only_itself(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = _sqlite(tmp_path)
    t = Tracker.start(uri, "exp", "run-b", {})
    t.names = lambda n: (n, False)  # type: ignore[assignment]  (unsanitised: MLflow refuses the batch)
    t.metrics({"bad(name)": 1.0, "good": 2.0, "also/good": 3.0}, 1)
    t.metrics({"good": 4.0}, 2)
    assert t.close(timeout_s=30)
    metrics = MlflowClient(uri).get_run(t.run_id).data.metrics
    assert metrics["good"] == 4.0 and metrics["also/good"] == 3.0 and "bad(name)" not in metrics
    assert t.writer.dropped == 1 and metrics["tracking/dropped"] == 1.0  # logged with the next metrics


def test_dead_server_never_blocks_a_step_and_drops_are_counted(monkeypatch):
    monkeypatch.setattr(tracking, "BACKOFF_MAX_S", 0.5)
    srv = _FakeMlflow()
    t = Tracker(srv.uri, "run-c", queue_size=5)
    t.metrics({"loss": 1.0}, 1)
    _wait(lambda: len(srv.batches()) == 1)
    srv.stop()  # the server dies mid-run
    t0 = time.monotonic()
    for step in range(2, 32):
        s0 = time.monotonic()
        t.metrics({"loss": float(step)}, step)
        assert time.monotonic() - s0 < 0.5  # returns at once: never waits out a retry (margin for load)
    assert time.monotonic() - t0 < 5
    assert t.writer.dropped >= 24  # 30 calls: the queue holds 5, one may be in flight
    srv.start()  # back: what the queue held is written, with the count of the dropped ones
    assert t.close(timeout_s=60, give_up_s=60)
    steps = [m["step"] for b in srv.batches() for m in b.get("metrics", []) if m["key"] == "loss"]
    assert steps[0] == 1 and len(steps) == 1 + 30 - t.writer.dropped
    dropped = [
        m["value"] for b in srv.batches() for m in b.get("metrics", []) if m["key"] == "tracking/dropped"
    ]
    assert dropped and dropped[-1] == t.writer.dropped
    srv.stop()


def test_unreachable_server_costs_the_end_seconds_not_minutes(caplog):
    t = Tracker(f"http://127.0.0.1:{_closed_port()}", "run-d", queue_size=100)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="app.infra.tracking"):
        for step in range(1, 51):
            t.metrics({"loss": 1.0}, step)
        assert time.monotonic() - t0 < 5  # queued, never sent inline
        assert not t.close(timeout_s=30, give_up_s=2)
    assert time.monotonic() - t0 < 15
    assert t.writer.dropped == 50
    assert any("training goes on" in r.message for r in caplog.records)


def test_start_refuses_an_unreachable_server_within_seconds(tmp_path):
    uri = f"http://127.0.0.1:{_closed_port()}"
    t0 = time.monotonic()
    with pytest.raises(TrackingError, match=f"tracking.uri={uri}: no MLflow server answers"):
        Tracker.start(uri, "exp", "x", {})
    assert time.monotonic() - t0 < 5


def test_probe_times_out_on_a_server_that_never_answers():
    with socket.socket() as s:  # listens (connect succeeds) but never accepts nor answers
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        uri = f"http://127.0.0.1:{s.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(TrackingError, match="no MLflow server answers"):
            check_reachable(uri, timeout_s=1.0)
        assert time.monotonic() - t0 < 4
    srv = _FakeMlflow()
    check_reachable(srv.uri)  # a server that answers passes
    check_reachable("sqlite:///nowhere/mlflow.db")  # not probed
    srv.stop()


_START = """
import sys, time
from app.infra.tracking import Tracker
go = float(sys.argv[2])
time.sleep(max(0.0, go - time.time()))
t = Tracker.start(sys.argv[1], "shared", sys.argv[3], {"a": 1})
t.metrics({"loss": 1.0}, 1)
assert t.end("FINISHED")
"""


def test_two_processes_create_the_same_sqlite_store_at_once(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = _sqlite(tmp_path)
    go = time.time() + 6  # both past their imports: they create and migrate the store at the same moment
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _START, uri, str(go), f"run-{i}"],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120)[0])
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("shared")
    runs = client.search_runs([exp.experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["run-0", "run-1"]
    assert all(r.info.status == "FINISHED" for r in runs)


def test_artifacts_land_under_run_dir_not_the_working_directory(tmp_path, monkeypatch, caplog):
    """A run started from a directory that does not last (under `ray job submit --working-dir`, Ray's copy
    of it) keeps its artifacts under run_dir: MLflow's own default for a new experiment is ./mlruns of the
    process that creates it. Checked through MLflow's client."""
    from mlflow.tracking import MlflowClient

    from app.infra.tracking_store import artifact_root

    root, work = tmp_path / "runs", tmp_path / "job-copy"
    work.mkdir()
    monkeypatch.chdir(work)
    uri = tracking_store.default_uri(str(root))
    t = Tracker.start(uri, "exp", "run-art", {}, artifact_root("", uri, root))
    t.text("hello", "notes/hello.txt")
    assert t.end("FINISHED")
    art = MlflowClient(uri).get_run(t.run_id).info.artifact_uri
    assert Path(art.removeprefix("file://")).is_relative_to(root / "mlartifacts"), art
    assert (Path(art.removeprefix("file://")) / "notes" / "hello.txt").read_text() == "hello"
    assert list(work.iterdir()) == []  # nothing in the working directory
    # an experiment created elsewhere keeps its location (MLflow fixes it at creation): said, not hidden
    with caplog.at_level(logging.WARNING, logger="app.infra.tracking_store"):
        Tracker.start(uri, "exp", "run-art2", {}, str(tmp_path / "elsewhere")).end()
    assert any("another tracking.experiment" in r.message for r in caplog.records)
    # tracking.artifact_uri wins; a tracking server keeps its own default
    assert artifact_root("~/arts", uri, root) == str(Path.home() / "arts")
    assert artifact_root("s3://bucket/relay", uri, root) == "s3://bucket/relay"
    assert artifact_root("", "http://127.0.0.1:5000", root) is None


def test_reward_curve_draws_validation_at_the_version_it_measured(tmp_path):
    """fully_async: the validation of version 5 lands (is logged) at step 8; the curve draws it at 5, and its
    title names the run."""
    from mlflow.tracking import MlflowClient

    uri = _sqlite(tmp_path)
    t = Tracker.start(uri, "exp", "run-curve", {})
    t.metrics({"val/reward": 0.1, "val/version": 0}, 0)
    for step in range(1, 11):
        t.metrics({"reward/mean": step / 10}, step)
    t.metrics({"val/reward": 0.5, "val/version": 5}, 8)
    t.metrics({"val/reward": 0.9, "val/version": 10}, 10)
    t.reward_curve(str(tmp_path))
    assert t.end("FINISHED")
    series = t.curve_series()
    assert series["val/reward"] == ([0.0, 5.0, 10.0], [0.1, 0.5, 0.9])
    assert series["reward/mean"][0] == [float(s) for s in range(1, 11)]
    assert "reward_curve.png" in {a.path for a in MlflowClient(uri).list_artifacts(t.run_id)}
    assert (tmp_path / "reward_curve.png").stat().st_size > 0


SERVER_START_S = (
    240.0  # `mlflow server` imports and migrates its store: ~15 s idle, minutes on a busy 2-core box
)
LOG_CALL_BOUND_S = 1.0  # what one step's tracking calls may cost the trainer, the server dead or alive


def _start_mlflow_server(tmp_path: Path) -> tuple[subprocess.Popen, str]:
    """A real `mlflow server` (HTTP, SQLite backend in tmp_path) in its own process group; waits for /health."""
    port = _closed_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job-runner processes
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port)),
            *("--workers", "1", "--backend-store-uri", _sqlite(tmp_path)),
            *("--default-artifact-root", str(tmp_path / "artifacts")),
        ],
        stdout=open(tmp_path / "server.log", "w"),  # noqa: SIM115 (the child holds it)
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=env,
    )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_START_S
    while True:
        try:
            check_reachable(uri, timeout_s=1.0)
            return proc, uri
        except TrackingError:
            if proc.poll() is not None or time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
                pytest.fail(f"mlflow server did not start: {(tmp_path / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)


def _step_metrics(step: int) -> dict[str, float]:
    """About what trainer rank 0 logs each step (app/train_loop.py), sub-scores and timings included."""
    names = ["reward/mean", "reward/std", "loss/policy", "loss/kl", "sync/time_s", "gen/tokens_per_s"]
    return {**{n: step + i / 10 for i, n in enumerate(names)}, "reward/sub/acc(strict)": step / 10}


def test_real_mlflow_server_killed_mid_run_costs_no_step_and_counts_the_drops(tmp_path, caplog):
    """The issue's case at the tracking sink: a real `mlflow server`, steps logged as the trainer does, the
    server (every process of it) SIGKILLed after step 2. Each later step's calls return within
    LOG_CALL_BOUND_S, the trainer's end (`close()` with its defaults) within FLUSH_GIVE_UP_S + 10 s, and every
    call the dead server never got is counted in `tracking/dropped` and said in the log."""
    from mlflow.tracking import MlflowClient

    proc, uri = _start_mlflow_server(tmp_path)
    try:
        t = Tracker.start(uri, "exp", "run-kill", {"train.steps": 10})
        for step in (1, 2):
            t.metrics(_step_metrics(step), step)
        assert t.writer.wait(lambda: t.writer.pending() == 0, timeout_s=60, give_up_s=60)
        got = MlflowClient(uri).get_metric_history(t.run_id, "loss/policy")
        assert [m.step for m in got] == [1, 2]  # the server took the first steps
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the server dies mid-run
        proc.wait(timeout=30)
    slowest = 0.0
    with caplog.at_level(logging.WARNING, logger="app.infra.tracking"):
        for step in range(3, 11):
            s0 = time.monotonic()
            t.metrics(_step_metrics(step), step)
            t.table([{"prompt": "max:3815=", "reward": 1.0}], f"samples/val_v{step:05d}.json")
            slowest = max(slowest, time.monotonic() - s0)
            time.sleep(0.2)  # the step's own work
        s0 = time.monotonic()
        assert not t.close()  # the trainer's end, with its default deadlines: not everything was written
        ended_in = time.monotonic() - s0
    assert slowest < LOG_CALL_BOUND_S, f"a tracking call held a step {slowest:.2f} s"
    assert ended_in < tracking.FLUSH_GIVE_UP_S + 10, f"the end took {ended_in:.1f} s"
    assert t.writer.dropped == 16  # 8 steps' metrics and 8 tables: none reached the dead server
    messages = [r.getMessage() for r in caplog.records]
    assert any("retrying in the background, training goes on" in m for m in messages)
    assert any("16 tracking calls of this process were dropped" in m for m in messages), messages


# ------------------------------------------------------------------ the final model (tracking.log_model)


def _model_folder(path: Path, kb: int) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"\0" * kb * 1024)
    return path


def test_final_model_is_copied_under_the_limit_else_referenced_and_registered_either_way(tmp_path):
    """auto copies a small model into the run's artifacts and registers the copy; a model over
    `log_model_max_mb` is only referenced (its path in `relay.final_model`, nothing copied) and registered
    from its folder; off leaves the run without either."""
    from mlflow.tracking import MlflowClient

    uri = _sqlite(tmp_path)
    client = MlflowClient(uri)
    final = _model_folder(tmp_path / "run" / "final", 64)  # 0.07 MB
    arts = str(tmp_path / "mlartifacts")

    small = Tracker.start(uri, "exp", "small", {}, arts)
    assert small.log_model(final, "auto", 1.0, "relay-small") == "copy"
    assert small.end()
    got = {a.path for a in client.list_artifacts(small.run_id, "final")}
    assert got == {"final/config.json", "final/model.safetensors"}
    (mv,) = client.search_model_versions("name='relay-small'")
    assert mv.source == f"runs:/{small.run_id}/final"

    big = Tracker.start(uri, "exp", "big", {}, arts)
    assert big.log_model(final, "auto", 0.05, "relay-big") == "reference"
    assert big.end()
    run = client.get_run(big.run_id)
    assert run.data.tags["relay.final_model"] == str(final.resolve())
    assert run.data.tags["relay.final_model_logged"] == "reference"
    assert client.list_artifacts(big.run_id) == []  # no second copy
    (mv,) = client.search_model_versions("name='relay-big'")
    assert mv.source == str(final.resolve())

    off = Tracker.start(uri, "exp", "off", {}, arts)
    assert off.log_model(final, "off", 1e6) == "off"
    assert off.end()
    assert "relay.final_model" not in client.get_run(off.run_id).data.tags
    assert client.list_artifacts(off.run_id) == []
    # a tracking server registers only what its artifacts hold: auto copies whatever the size
    assert tracking.model_logging("auto", final, 0.05, needs_copy=True) == "copy"
    assert tracking.model_logging("copy", final, 0.0) == "copy"


def test_log_model_settings_that_cannot_register_are_refused_at_load():
    from app.config import ConfigError, load_config

    assert load_config(None, []).tracking.log_model == "auto"
    with pytest.raises(ConfigError, match="tracking.log_model.*no model to register"):
        load_config(None, ["tracking.register_model=m", "tracking.log_model=off"])
    server = ["tracking.uri=http://127.0.0.1:5000", "tracking.register_model=m"]
    with pytest.raises(ConfigError, match="a server registers only models in its artifacts"):
        load_config(None, [*server, "tracking.log_model=reference"])
    load_config(None, [*server, "tracking.log_model=auto"])  # auto copies there
    load_config(None, ["tracking.register_model=m", "tracking.log_model=reference"])  # a local store: fine


# ------------------------------------------------------------------ a reopened run


def test_a_reopened_run_is_running_again_and_goes_on_at_its_steps(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = _sqlite(tmp_path)
    client = MlflowClient(uri)
    first = Tracker.start(uri, "exp", "r", {"train.lr": 0.001, "train.resume": ""})
    for step in (1, 2):
        first.metrics({"loss": 1.0 / step}, step)
    assert first.end("FAILED")
    params = {"train.lr": 0.001, "train.resume": "/ckpt", "train.steps": 9}
    again = Tracker.start(uri, "exp", "r", params, reopen=first.run_id)
    assert again.reopened and again.run_id == first.run_id
    assert client.get_run(first.run_id).info.status == "RUNNING"
    again.metrics({"loss": 0.25}, 3)
    assert again.end("FINISHED")
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(first.run_id, "loss")] == [1, 2, 3]
    assert run.data.params["train.steps"] == "9" and run.data.params["train.resume"] == ""  # MLflow keeps it
    assert json.loads(run.data.tags["relay.params_changed"]) == {"train.resume": "/ckpt"}
    gone = Tracker.start(uri, "exp", "r", {}, reopen="0" * 32)  # a run this store does not have: a new one
    assert not gone.reopened and gone.run_id != first.run_id
    assert gone.end()


# ------------------------------------------------------------------ sinks beside MLflow (tracking.sinks)


def test_tensorboard_gets_what_mlflow_and_metrics_jsonl_get(tmp_path):
    """The same `metrics` calls reach MLflow, metrics.jsonl and a TensorBoard event file, read back with
    TensorBoard's own reader."""
    pytest.importorskip("tensorboard")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from app.infra.tracking_sinks import TENSORBOARD_DIR, open_sinks

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    sinks = open_sinks(["tensorboard"], run_dir, "exp", "w0")
    uri = _sqlite(tmp_path)
    t = Tracker.start(uri, "exp", "tb", {}, jsonl=run_dir / METRICS_FILE, sinks=sinks)
    t.metrics({"reward/mean": 0.5, "loss": 2.0, "skip": math.nan}, 1)
    t.metrics({"reward/mean": 0.75}, 2)
    assert t.end()
    acc = EventAccumulator(str(run_dir / TENSORBOARD_DIR))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["loss", "reward/mean"]
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.5), (2, 0.75)]
    history = MlflowClient(uri).get_metric_history(t.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.75)]
    assert len((run_dir / METRICS_FILE).read_text().splitlines()) == 2


class _FailingSink:
    """A sink whose every call fails, as a full disk or a lost W&B service would."""

    name = "flaky"

    def __init__(self) -> None:
        self.calls = 0

    def log(self, values: dict, step: int) -> None:
        self.calls += 1
        raise OSError("No space left on device")

    def release(self) -> None:
        raise OSError("No space left on device")

    close = release


def test_a_failing_sink_is_warned_about_once_and_never_stops_a_step(tmp_path, caplog):
    from mlflow.tracking import MlflowClient

    from app.infra.tracking_sinks import Sinks

    uri = _sqlite(tmp_path)
    bad = _FailingSink()
    t = Tracker.start(uri, "exp", "flaky", {}, sinks=Sinks([bad]))
    with caplog.at_level(logging.WARNING, logger="app.infra.tracking_sinks"):
        for step in range(1, 4):
            t.metrics({"loss": 1.0}, step)
        assert t.end()
    assert bad.calls == 3  # still fed: a failure may pass
    warned = [r.getMessage() for r in caplog.records if "flaky" in r.getMessage()]
    assert len(warned) == 1 and "training goes on" in warned[0], warned
    assert len(MlflowClient(uri).get_metric_history(t.run_id, "loss")) == 3  # MLflow unaffected


def test_sinks_config_names_the_missing_package_and_keeps_mlflow():
    from app.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="mlflow among them"):
        load_config(None, ["tracking.sinks=[tensorboard]"])
    with pytest.raises(ConfigError, match="at most once"):
        load_config(None, ["tracking.sinks=[mlflow,mlflow]"])
    for sink in ("wandb", "tensorboard"):
        import importlib.util

        if importlib.util.find_spec(sink) is None:
            with pytest.raises(ConfigError, match=f"pip install {sink}"):
                load_config(None, [f"tracking.sinks=[mlflow,{sink}]"])
        else:
            assert load_config(None, [f"tracking.sinks=[mlflow,{sink}]"]).tracking.sinks == ["mlflow", sink]


def test_a_sink_whose_package_is_missing_fails_at_start_naming_pip_install(tmp_path, monkeypatch):
    from app.infra.tracking_sinks import SinkError, open_sinks

    monkeypatch.setitem(sys.modules, "wandb", None)  # as on a node without it: `import wandb` fails
    with pytest.raises(SinkError, match="pip install wandb"):
        open_sinks(["wandb"], tmp_path, "exp", "w1")


class _StandInWandb:
    """Stands in for the `wandb` package where it is not installed: records what W&B would be asked."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.inits: list[dict] = []
        self.logged: list[dict] = []
        self.defined: list[tuple] = []
        self.finished = 0
        self.fail = fail

    def init(self, **kw):
        if self.fail is not None:
            raise self.fail
        self.inits.append(kw)
        return self

    def define_metric(self, *args, **kw) -> None:
        self.defined.append((args, kw))

    def log(self, values: dict) -> None:
        self.logged.append(values)

    def finish(self) -> None:
        self.finished += 1


def test_wandb_run_is_opened_at_start_then_handed_over_and_logged_against_relay_step(tmp_path, monkeypatch):
    """The driver opens the W&B run at start (a login problem fails there, naming the fix), lets it go for
    the trainer, which opens the same id (resume allowed) and logs each step against `relay/step`."""
    from app.infra.tracking_sinks import STEP_KEY, SinkError, open_sinks

    w = _StandInWandb()
    monkeypatch.setitem(sys.modules, "wandb", w)
    driver = open_sinks(["wandb"], tmp_path / "run-a", "exp", "abc123", {"train.lr": 0.001})
    assert w.inits == [
        {
            "project": "exp",
            "name": "run-a",
            "id": "abc123",
            "resume": "allow",
            "dir": str(tmp_path / "run-a"),
            "config": {"train.lr": 0.001},
        }
    ]
    assert (("*",), {"step_metric": STEP_KEY}) in w.defined
    driver.release()
    assert w.finished == 1
    trainer = open_sinks(["wandb"], tmp_path / "run-a", "exp", "abc123")
    trainer.log({"loss": 2.0}, 7)
    trainer.close()
    assert w.inits[-1]["id"] == "abc123" and w.inits[-1]["config"] is None
    assert w.logged == [{"loss": 2.0, STEP_KEY: 7}] and w.finished == 2
    monkeypatch.setitem(sys.modules, "wandb", _StandInWandb(fail=RuntimeError("api_key not configured")))
    with pytest.raises(SinkError, match="wandb login"):
        open_sinks(["wandb"], tmp_path / "run-b", "exp", "def456")
