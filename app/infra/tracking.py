"""MLflow tracking that never holds training; a tracking store that does not work fails the run at start.

start     before Ray starts (app/infra/tracking_store.py): the store probed, the experiment and the run created,
          or the run of a resumed run folder reopened. A failure raises TrackingError, naming the URI.
calls     `metrics`, `tags`, `artifact`, `table`, `text`, `reward_curve` only queue the call and return at
          once. One background thread ("relay-tracking") writes them in order. Metrics linger up to
          METRICS_LINGER_S in a buffer: the calls that arrive meanwhile go to MLflow in one `log_batch` (one
          SQLite commit for several steps of a fast loop, not one a step); `close` writes them at once. A call that fails for a
          reason that may pass (connection, timeout, 5xx, a locked database) is retried with backoff
          (1 s doubling to 30 s) while later calls wait in the bounded queue (QUEUE_SIZE); a call the
          queue cannot take, a call not written within JOB_MAX_AGE_S, or one MLflow rejects outright is
          dropped: a warning (at most every WARN_EVERY_S) and `tracking/dropped`, the count so far, logged
          with the next metrics. MLflow's own HTTP retries are set low (`http_defaults`): the retrying is
          ours, off the training thread.
names     metric names are made safe for MLflow (`safe_metric_name`); a renamed one is warned about once
          and the mapping kept in the run's tag `relay.renamed_metrics`. A batch MLflow still rejects is
          written one metric at a time, so one bad metric never drops the others.
sinks     each `metrics` call also goes to the run folder's metrics.jsonl (`MetricsFile`) and to the other
          sinks of `tracking.sinks` (TensorBoard, W&B: app/infra/tracking_sinks.py), on the caller's thread:
          each only queues, and none raises.
model     `log_model`: the final model copied into the run's artifacts, or its folder's path kept in the tag
          `relay.final_model` (`tracking.log_model`; a 7B model is ~15 GB more as a copy), and registered.
end       `close` (trainer) and `end` (driver, also sets the run's status) flush the queue within
          FLUSH_TIMEOUT_S, giving up after FLUSH_GIVE_UP_S of failures: a dead server costs the run's end
          seconds, not minutes; what is left is counted as dropped.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import numbers
import os
import re
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from app.infra.tracking_sinks import Sinks
from app.infra.tracking_store import (
    SERVER_SCHEMES,
    TrackingError,
    check_reachable,
    create_run,
    http_defaults,
    reopen_run,
    store_lock,
)

log = logging.getLogger(__name__)

QUEUE_SIZE = 1000
JOB_MAX_AGE_S = 600.0
BACKOFF_S, BACKOFF_MAX_S = 1.0, 30.0
WARN_EVERY_S = 60.0
FLUSH_TIMEOUT_S = 600.0  # a final checkpoint upload to a live server may take minutes
FLUSH_GIVE_UP_S = 20.0
MAX_KEY_LEN = 250  # mlflow.utils.validation.MAX_ENTITY_KEY_LENGTH
MAX_BATCH = 1000  # metrics per log_batch request
METRICS_LINGER_S = 1.0  # the longest a metrics call waits for later ones to share its log_batch
# errors MLflow answers for the request itself: retrying sends the same request to the same answer
_PERMANENT = {
    "INVALID_PARAMETER_VALUE",
    "BAD_REQUEST",
    "INVALID_REQUEST",
    "RESOURCE_DOES_NOT_EXIST",
    "RESOURCE_ALREADY_EXISTS",
    "INVALID_STATE",
    "PERMISSION_DENIED",
    "UNAUTHENTICATED",
    "ENDPOINT_NOT_FOUND",
}
_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. /:]")


def safe_metric_name(name: str) -> str:
    """`name` with what MLflow refuses replaced by `_`: characters other than letters, digits, `_-. /:`,
    empty, `.` or `..` path segments (MLflow treats names as paths), and length past 250."""
    s = _UNSAFE.sub("_", str(name))
    parts = ["_" if p in (".", "..") else p for p in s.split("/") if p]
    s = "/".join(parts)[:MAX_KEY_LEN].rstrip("/")
    return s or "_"


class MetricNames:
    """Original metric name -> the name logged. Distinct originals never share a logged name."""

    def __init__(self) -> None:
        self.renamed: dict[str, str] = {}
        self._safe: dict[str, str] = {}
        self._owner: dict[str, str] = {}

    def __call__(self, name: str) -> tuple[str, bool]:
        """The logged name, and whether `name` was renamed for the first time now."""
        got = self._safe.get(name)
        if got is not None:
            return got, False
        safe, base, i = safe_metric_name(name), None, 1
        while self._owner.get(safe, name) != name:
            base = base or safe
            i += 1
            safe = f"{base[: MAX_KEY_LEN - 4]}_{i}"
        self._safe[name], self._owner[safe] = safe, name
        if safe == name:
            return safe, False
        self.renamed[name] = safe
        why = "MLflow refuses the original name" if base is None else "its name is taken by a renamed metric"
        log.warning("metric %r is logged to MLflow as %r (%s)", name, safe, why)
        return safe, True


def _transient(e: BaseException) -> bool:
    """A failure that a later retry may not meet: connection, timeout, server error, a locked database."""
    from mlflow.exceptions import MlflowException

    if isinstance(e, MlflowException):
        return getattr(e, "error_code", "") not in _PERMANENT
    return isinstance(e, OSError)


@dataclass
class _Job:
    what: str
    fn: Callable[[], Any]
    queued_at: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    not_before: float = 0.0  # monotonic: the writer starts it no earlier (unless closing)

    @property
    def calls(self) -> int:
        """The tracking calls this job writes (a metrics flush carries several), for the drop count."""
        return int(getattr(self.fn, "calls", 1))


class BackgroundWriter:
    """One thread that runs queued calls in order, retrying transient failures with backoff. `submit` never
    blocks: a full queue drops the call. Loop contract: consumes `_jobs`; waits on `_cv` for a job or `stop`;
    a failing job waits out its backoff (or `stop`) and is dropped past `max_age_s` or when `close` gives up."""

    def __init__(self, uri: str, max_jobs: int = QUEUE_SIZE, max_age_s: float = JOB_MAX_AGE_S) -> None:
        self.uri, self.max_jobs, self.max_age_s = uri, max_jobs, max_age_s
        self.dropped = 0
        self._jobs: collections.deque[_Job] = collections.deque()
        self._cv = threading.Condition()
        self._busy = self._stopped = self._hurry = False  # _hurry: closing, no job lingers
        self._give_up_s: float | None = None  # set by close: how long failures may go on
        self._failing_since: float | None = None
        self._warned_at = -math.inf
        self._thread = threading.Thread(target=self._loop, name="relay-tracking", daemon=True)
        self._thread.start()

    def submit(self, what: str, fn: Callable[[], Any], linger_s: float = 0.0) -> _Job | None:
        """Queue `fn` (returns at once), to start no sooner than `linger_s` from now unless the writer is
        closing; None where it was dropped (queue full, or closed)."""
        job = _Job(what, fn, not_before=time.monotonic() + linger_s)
        with self._cv:
            why = "closed" if self._stopped else "queue full" if len(self._jobs) >= self.max_jobs else ""
            if not why:
                self._jobs.append(job)
                self._cv.notify_all()
                return job
        self.drop(1, what, f"{why} ({self.max_jobs} calls waiting for MLflow)" if why != "closed" else why)
        return None

    def drop(self, n: int, what: str, why: str) -> None:
        """Count `n` calls dropped; warn (the first time, then at most every WARN_EVERY_S)."""
        with self._cv:
            self.dropped += n
            total, now = self.dropped, time.monotonic()
            if now - self._warned_at < WARN_EVERY_S:
                return
            self._warned_at = now
        log.warning(
            "MLflow at %s: dropped %s: %s (%d tracking calls dropped so far, logged as tracking/dropped; "
            "training goes on)",
            self.uri,
            what,
            why,
            total,
        )

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._stopped:
                    self._cv.wait(1.0)
                if self._stopped:
                    return
                job, self._busy = self._jobs.popleft(), True
                self._linger(job.not_before)
            try:
                self._run(job)
            finally:
                job.done.set()
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _linger(self, until: float) -> None:
        """Hold the job just taken until `until` (monotonic), or until the writer closes (lock held)."""
        self._cv.wait_for(
            lambda: self._stopped or self._hurry or time.monotonic() >= until,
            timeout=max(0.0, until - time.monotonic()),
        )

    def _run(self, job: _Job) -> None:
        attempt = 0
        while True:
            started = time.monotonic()
            try:
                job.result = job.fn()
                if self._failing_since is not None:
                    log.warning("MLflow at %s answers again (after %.0f s)", self.uri, self._elapsed())
                    self._failing_since = None
                return
            except Exception as e:
                if not _transient(e):
                    self.drop(job.calls, job.what, f"MLflow refused it: {type(e).__name__}: {e}")
                    return
                attempt += 1
                if self._failing_since is None:  # from the start of the failed call: a hung server counts
                    self._failing_since = started
                    log.warning(
                        "MLflow at %s failed (%s: %s); retrying in the background, training goes on",
                        self.uri,
                        type(e).__name__,
                        str(e)[:300],
                    )
                if self._stopped or self._giving_up() or time.monotonic() - job.queued_at > self.max_age_s:
                    self.drop(job.calls, job.what, f"not written in time: {type(e).__name__}: {str(e)[:300]}")
                    return
                with self._cv:
                    self._cv.wait_for(
                        lambda: self._stopped, timeout=min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (attempt - 1))
                    )

    def _elapsed(self) -> float:
        return 0.0 if self._failing_since is None else time.monotonic() - self._failing_since

    def _giving_up(self) -> bool:
        return self._give_up_s is not None and self._elapsed() > self._give_up_s

    def wait(self, done: Callable[[], bool], timeout_s: float, give_up_s: float) -> bool:
        """Until `done()` (checked under the queue's lock), `timeout_s`, or `give_up_s` of failing writes."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while not done():
                left = deadline - time.monotonic()
                if left <= 0 or self._stopped or self._elapsed() > give_up_s:
                    return False
                self._cv.wait(min(0.5, left))
        return True

    def pending(self) -> int:
        return len(self._jobs) + int(self._busy)

    def close(self, timeout_s: float = FLUSH_TIMEOUT_S, give_up_s: float = FLUSH_GIVE_UP_S) -> bool:
        """Write what is queued within the deadlines, then stop; True if nothing was left unwritten."""
        self._give_up_s = give_up_s
        with self._cv:
            self._hurry = True
            self._cv.notify_all()
        ok = self.wait(lambda: not self._jobs and not self._busy, timeout_s, give_up_s)
        with self._cv:
            self._stopped = True
            left = sum(job.calls for job in self._jobs)
            self._jobs.clear()
            self._cv.notify_all()
        if left:
            self.drop(left, f"{left} queued calls", "not written by the end of the run")
        self._thread.join(timeout=5.0)
        if self.dropped:
            log.warning(
                "MLflow at %s: %d tracking calls of this process were dropped", self.uri, self.dropped
            )
        return ok and not left


METRICS_FILE = "metrics.jsonl"


class MetricsFile:
    """Metrics appended to a local JSON-lines file, one line a call, each written whole (O_APPEND), so the
    trainer and the driver can share one; a write that fails is warned about once and never raises."""

    def __init__(self, path: Path) -> None:
        self.path, self.failed = path, False

    def append(self, step: int, time_s: float, values: dict[str, float]) -> None:
        line = json.dumps({"step": step, "time": round(time_s, 3), **values}, allow_nan=False) + "\n"
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError as e:
            if not self.failed:
                log.warning("could not append metrics to %s (%s); MLflow still gets them", self.path, e)
            self.failed = True


@dataclass
class _Calls:
    items: list[Any] = field(default_factory=list)  # mlflow Metric entities, in call order
    count: int = 0  # the `metrics` calls they came from
    ts: int = 0  # the last call's time (ms) and step
    step: int = 0


class _MetricsFlush:
    """The writer's job for the buffered metrics calls: it takes them from the buffer when it first runs
    (what arrives after that goes to the next flush) and writes them in one `log_batch` per MAX_BATCH.
    `calls` is how many calls it carries, for the writer's drop count."""

    def __init__(self, buffer: _MetricsBuffer, write: Callable[[_Calls], None]) -> None:
        self.buffer, self.write = buffer, write
        self.taken: _Calls | None = None

    @property
    def calls(self) -> int:
        return self.taken.count if self.taken is not None else self.buffer.count()

    def take(self) -> _Calls:
        if self.taken is None:
            self.taken = self.buffer.take()
        return self.taken

    def __call__(self) -> None:
        self.write(self.take())


class _MetricsBuffer:
    """Metrics calls waiting for their flush, at most `max_calls` of them (beyond: dropped, as a full queue
    drops). Exactly one flush is queued while it holds calls."""

    def __init__(self, max_calls: int, write: Callable[[_Calls], None]) -> None:
        self.max_calls, self.write = max_calls, write
        self.lock = threading.Lock()
        self.pending = _Calls()
        self.flush: _MetricsFlush | None = None

    def add(self, items: list[Any], ts: int, step: int) -> _MetricsFlush | bool:
        """Buffer one call's `items`: a new flush to queue (the buffer was empty), True (the flush queued
        already takes them), or False where the buffer is full (the call is dropped: the caller counts it)."""
        with self.lock:
            if self.pending.count >= self.max_calls:
                return False
            p = self.pending
            p.items.extend(items)
            p.count, p.ts, p.step = p.count + 1, ts, step
            if self.flush is not None:
                return True
            self.flush = _MetricsFlush(self, self.write)
            return self.flush

    def take(self) -> _Calls:
        with self.lock:
            calls, self.pending, self.flush = self.pending, _Calls(), None
            return calls

    def count(self) -> int:
        with self.lock:
            return self.pending.count


class Tracker:
    """One MLflow run, written through a BackgroundWriter (usable from any process that knows the run id).
    With `jsonl` (the run folder's `metrics.jsonl`), every `metrics` call is also appended there as one JSON
    line, `{"step": ..., "time": ..., name: value, ...}` (the names as given, before MLflow's renaming): the
    run's numbers without MLflow, for `jq` or pandas; `sinks` (TensorBoard, W&B) get the same numbers."""

    def __init__(
        self,
        uri: str,
        run_id: str,
        queue_size: int = QUEUE_SIZE,
        jsonl: str | Path | None = None,
        sinks: Sinks | None = None,
    ) -> None:
        from mlflow.tracking import MlflowClient

        http_defaults()
        self.uri, self.run_id = uri, run_id
        self.jsonl = MetricsFile(Path(jsonl)) if jsonl is not None else None
        self.sinks = sinks or Sinks()
        self.reopened = False  # a resumed run folder's MLflow run, continued
        self.client = MlflowClient(tracking_uri=uri)
        self.names = MetricNames()
        self.writer = BackgroundWriter(uri, queue_size)
        self._buffer = _MetricsBuffer(queue_size, lambda c: self._write_metrics(c.items, c.ts, c.step))
        self._dropped_logged = 0
        self._sysmon: Any = None

    @classmethod
    def start(
        cls,
        uri: str,
        experiment: str,
        run_name: str | None,
        params: dict[str, Any],
        artifact_location: str | None = None,
        jsonl: str | Path | None = None,
        sinks: Sinks | None = None,
        reopen: str = "",
    ) -> Tracker:
        """Create the MLflow run (synchronously, before Ray starts), or continue run `reopen` where the store
        has it (`reopened` says which); raises TrackingError naming the URI. `artifact_location` (see
        `artifact_root`) applies where the experiment is created now."""
        http_defaults()
        check_reachable(uri)
        try:
            with store_lock(uri):
                run_id = reopen if reopen and reopen_run(uri, reopen, params) else ""
                run_id = run_id or create_run(uri, experiment, run_name, params, artifact_location)
        except Exception as e:
            raise TrackingError(
                f"tracking.uri={uri}: could not create the MLflow run ({type(e).__name__}: {str(e)[:500]}); "
                "check that the tracking server or store works, or leave tracking.uri empty for a local "
                "SQLite store under run_dir"
            ) from e
        tracker = cls(uri, run_id, jsonl=jsonl, sinks=sinks)
        tracker.reopened = run_id == reopen
        return tracker

    def tags(self, values: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, str(v)[:8000]) for k, v in values.items()]
        self.writer.submit(f"tags {sorted(values)}", lambda: self.client.log_batch(self.run_id, tags=items))

    def metrics(self, values: dict[str, float], step: int) -> None:
        """Queue the finite numbers of `values` at `step` (names made safe); returns at once."""
        from mlflow.entities import Metric

        ts, items, renamed, kept = int(time.time() * 1000), [], False, {}
        for k, v in values.items():
            if isinstance(v, numbers.Real) and math.isfinite(float(v)):
                key, new = self.names(k)
                renamed |= new
                items.append(Metric(key, float(v), ts, step))
                kept[k] = float(v)
        if renamed:
            self.tags({"relay.renamed_metrics": json.dumps(self.names.renamed)})
        if self.jsonl is not None:
            self.jsonl.append(step, ts / 1000, kept)
        self.sinks.log(kept, step)
        flush = self._buffer.add(items, ts, step)
        if flush is False:
            self.writer.drop(
                1, f"metrics of step {step}", f"{self._buffer.max_calls} calls waiting for MLflow"
            )
        elif (
            flush is not True
            and self.writer.submit(f"metrics from step {step}", flush, METRICS_LINGER_S) is None
        ):
            flush.take()  # not queued (closed, or the queue is full): this call alone, dropped and counted there

    def _write_metrics(self, items: list[Any], ts: int, step: int) -> None:
        from mlflow.entities import Metric

        dropped = self.writer.dropped
        if dropped != self._dropped_logged:
            items = [*items, Metric("tracking/dropped", float(dropped), ts, step)]
        for i in range(0, len(items), MAX_BATCH):
            chunk = items[i : i + MAX_BATCH]
            try:
                self.client.log_batch(self.run_id, metrics=chunk)
            except Exception as e:
                if _transient(e):
                    raise
                self._write_one_by_one(chunk)
        self._dropped_logged = dropped
        if self.writer.dropped != dropped:  # metrics of this very batch refused: say so with it
            with suppress(Exception):  # else with the next batch
                self.client.log_batch(
                    self.run_id, metrics=[Metric("tracking/dropped", float(self.writer.dropped), ts, step)]
                )
                self._dropped_logged = self.writer.dropped

    def _write_one_by_one(self, items: list[Any]) -> None:
        """A batch MLflow refused: each metric alone, so one it refuses drops only itself."""
        for m in items:
            try:
                self.client.log_batch(self.run_id, metrics=[m])
            except Exception as e:
                if _transient(e):
                    raise
                self.writer.drop(1, f"metric {m.key!r}", f"MLflow refused it: {e}")

    def table(self, rows: list[dict[str, Any]], name: str) -> None:
        if not rows:
            return
        cols = {k: [r.get(k) for r in rows] for k in rows[0]}
        self.writer.submit(
            f"table {name}", lambda: self.client.log_table(self.run_id, data=cols, artifact_file=name)
        )

    def log_model(self, folder: str | Path, mode: str, max_mb: float, register_as: str = "") -> str:
        """The final model `folder` by `tracking.log_model` (`model_logging`): "copy" into the run's artifacts
        (as `<folder name>/`), "reference" (nothing copied), or "off". Unless off, the folder's path goes into
        the tag `relay.final_model` and, with `register_as`, the model is registered: the copy, or the folder
        itself (a local store keeps its path as the version's source). Returns what was done."""
        path = Path(folder).resolve()
        server = urlparse(self.uri).scheme in SERVER_SCHEMES
        how = model_logging(mode, path, max_mb, needs_copy=bool(register_as) and server)
        log.info("final model %s: %s (tracking.log_model=%s)", path, how, mode)
        if how == "off":
            return how
        if how == "copy":
            self.artifact(str(path), path.name)
        self.tags({"relay.final_model": str(path), "relay.final_model_logged": how})
        if register_as:
            self.register(f"runs:/{self.run_id}/{path.name}" if how == "copy" else str(path), register_as)
        return how

    def register(self, src: str, name: str, timeout_s: float = FLUSH_TIMEOUT_S) -> str | None:
        """Register `src` (a logged artifact folder's `runs:/` URI, or a folder's path) as a new version of
        model `name` once the calls queued before it are written; returns the version (None where it failed
        or did not finish in time)."""

        def reg() -> str:
            with suppress(Exception):
                self.client.create_registered_model(name)
            mv = self.client.create_model_version(name, src, run_id=self.run_id)
            log.info("registered %s as model %s version %s", src, name, mv.version)
            return str(mv.version)

        job = self.writer.submit(f"model registration {name}", reg)
        if job is None or not self.writer.wait(job.done.is_set, timeout_s, FLUSH_GIVE_UP_S):
            log.warning(
                "MLflow at %s: registering %s as model %s did not finish in time", self.uri, src, name
            )
            return None
        return job.result

    def artifact(self, path: str, artifact_path: str | None = None) -> None:
        def upload() -> None:
            if Path(path).is_dir():
                self.client.log_artifacts(self.run_id, path, artifact_path)
            else:
                self.client.log_artifact(self.run_id, path, artifact_path)

        self.writer.submit(f"artifact {path}", upload)

    def text(self, text: str, name: str) -> None:
        self.writer.submit(f"text {name}", lambda: self.client.log_text(self.run_id, text, name))

    def dict(self, d: dict[str, Any], name: str) -> None:
        self.text(json.dumps(d, indent=2, default=str), name)

    def start_system_metrics(self) -> None:
        """CPU, memory, disk, network (and GPU where present) of this node, sampled every 10 s into the run
        (MLflow's own thread)."""
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._sysmon = SystemMetricsMonitor(
                self.run_id, sampling_interval=10, resume_logging=self.reopened, tracking_uri=self.uri
            )
            self._sysmon.start()
        except Exception as e:
            log.warning("MLflow system metrics unavailable: %s", e)

    def reward_curve(self, out_dir: str) -> None:
        """Queue the plot of reward/mean and val/reward against the weight version, saved as PNG and logged."""
        self.writer.submit("reward curve", lambda: self._plot_reward_curve(out_dir))

    def curve_series(self) -> dict[str, tuple[list[float], list[float]]]:
        """The reward curve's points: `reward/mean` at its step (the step that trained the batch makes version
        = step), `val/reward` at the version it measured (`val/version`, logged with it: in fully_async a
        validation runs beside training and lands steps after the version it measured)."""
        out: dict[str, tuple[list[float], list[float]]] = {}

        def history(key: str) -> list[Any]:
            return sorted(
                self.client.get_metric_history(self.run_id, key), key=lambda m: (m.timestamp, m.step)
            )

        train = sorted(history("reward/mean"), key=lambda m: m.step)
        if train:
            out["reward/mean"] = ([float(m.step) for m in train], [m.value for m in train])
        val, versions = history("val/reward"), history("val/version")
        at = {(m.timestamp, m.step): m.value for m in versions}  # logged in one call with val/reward
        points = sorted((at.get((m.timestamp, m.step), float(m.step)), m.value) for m in val)
        if points:
            out["val/reward"] = ([x for x, _ in points], [y for _, y in points])
        return out

    def _plot_reward_curve(self, out_dir: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for key, (xs, ys) in self.curve_series().items():
            ax.plot(xs, ys, "-" if key == "reward/mean" else "o-", label=key)
        name = self.client.get_run(self.run_id).info.run_name or self.run_id
        ax.set_title(f"{name}: reward")
        ax.set_xlabel("weight version (= training step)")
        ax.set_ylabel("reward")
        ax.grid(alpha=0.3)
        ax.legend()
        path = Path(out_dir) / "reward_curve.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        self.client.log_artifact(self.run_id, str(path))

    def close(self, timeout_s: float = FLUSH_TIMEOUT_S, give_up_s: float = FLUSH_GIVE_UP_S) -> bool:
        """Flush the queued calls (within `timeout_s`; `give_up_s` once MLflow keeps failing), stop the
        writer and close the other sinks; True if everything was written to MLflow."""
        try:
            return self.writer.close(timeout_s, give_up_s)
        finally:
            self._buffer.take()  # what a dropped flush left (counted): a later call is dropped as "closed"
            self.sinks.close()

    def end(self, status: str = "FINISHED") -> bool:
        """Stop the system metrics, set the run's status, and `close`."""
        if self._sysmon is not None:
            self.writer.submit("stopping system metrics", self._sysmon.finish)
        self.writer.submit(
            f"run status {status}", lambda: self.client.set_terminated(self.run_id, status=status)
        )
        return self.close()


def folder_mb(path: str | Path) -> float:
    """The size of the files under `path`, in MB (10^6 bytes)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / 1e6


def model_logging(mode: str, folder: str | Path, max_mb: float, needs_copy: bool = False) -> str:
    """What `tracking.log_model=mode` does with the final model `folder`: "copy", "reference" or "off"; `auto`
    copies a model under `max_mb` (and where `needs_copy`: registering it on a tracking server, which takes
    only models in its artifacts), else references it."""
    if mode != "auto":
        return mode
    return "copy" if needs_copy or folder_mb(folder) < max_mb else "reference"
