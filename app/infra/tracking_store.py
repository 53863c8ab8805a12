"""Where a run's MLflow run lives: the store checked and the run created (or reopened) at start, before Ray.

probe     an HTTP tracking URI is probed (a few seconds); a failure raises TrackingError, naming the URI.
store     a local SQLite store is created, migrated and written under a file lock (`mlflow.db.lock`):
          concurrent runs share `run_dir`/mlflow.db, and two first runs would otherwise race creating it.
artifacts the experiment is created with an explicit artifact location (`artifact_root`: under `run_dir`
          for a local store): MLflow's default is `./mlruns` of the process that creates it, which under
          `ray job submit --working-dir` is Ray's temporary copy of the working directory.
reopen    `--resume` of a run folder continues its MLflow run (`reopen_run`): status RUNNING again, the
          params it did not have logged, the ones it had with another value kept in a tag (MLflow never
          changes a logged param). The run folder's `tracking.json` (`RUN_RECORD`) names the run.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0
STORE_LOCK_TIMEOUT_S = 120.0
# MLflow's defaults (7 retries, backoff factor 2, 120 s timeout) hold one call about 4 minutes on a dead server
HTTP_ENV = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}
SERVER_SCHEMES = ("http", "https", "databricks")
RUN_RECORD = "tracking.json"
"""In a run folder: the tracking URI, experiment and MLflow run id (and the W&B run id) of its run."""


class TrackingError(RuntimeError):
    """The tracking store cannot be used at start; the message names the URI and the fix."""


def default_uri(run_dir: str) -> str:
    path = Path(run_dir).expanduser().resolve() / "mlflow.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def artifact_root(artifact_uri: str, tracking_uri: str, run_root: Path) -> str | None:
    """Where a new experiment keeps its runs' artifacts: `tracking.artifact_uri` where set (a path is made
    absolute, `~` expanded); for a local store (SQLite, a folder) `<run_dir>/mlartifacts`, beside the store and
    the checkpoints; None for a tracking server (its own default: proxied artifacts or its
    `--default-artifact-root`)."""
    if artifact_uri:
        if "://" in artifact_uri:
            return artifact_uri
        return str(Path(artifact_uri).expanduser().resolve())
    if urlparse(tracking_uri).scheme in SERVER_SCHEMES:
        return None
    return str(Path(run_root).expanduser().resolve() / "mlartifacts")


def http_defaults() -> None:
    """MLflow's HTTP retries and timeout, low (HTTP_ENV), unless the environment sets them."""
    for k, v in HTTP_ENV.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def check_reachable(uri: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Raise TrackingError unless an HTTP(S) tracking URI answers within `timeout_s` (any HTTP answer, an
    error status included, counts: the server is there). Other URIs are not probed."""
    if urlparse(uri).scheme not in ("http", "https"):
        return
    url = uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s):
            return
    except urllib.error.HTTPError:
        return
    except (OSError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, ssl.SSLError):
            return  # a server answers; TLS settings are MLflow's (MLFLOW_TRACKING_INSECURE_TLS, ...)
        raise TrackingError(
            f"tracking.uri={uri}: no MLflow server answers there ({type(reason).__name__}: {reason}; probed "
            f"{url} for {timeout_s:.0f} s). Start the server (e.g. `mlflow server --host 127.0.0.1 --port "
            "5000`), correct tracking.uri, or leave tracking.uri empty for a local SQLite store under run_dir"
        ) from e


@contextmanager
def store_lock(uri: str, timeout_s: float = STORE_LOCK_TIMEOUT_S) -> Iterator[None]:
    """For a SQLite store, a file lock beside the database (`mlflow.db.lock`) while it is created, migrated
    and written at a run's start; nothing for other stores."""
    from app.infra.run_lock import file_lock

    path = uri[len("sqlite:///") :].split("?", 1)[0] if uri.startswith("sqlite:///") else ""
    if not path or path == ":memory:":
        yield
        return
    with file_lock(Path(path + ".lock"), timeout_s):
        yield


def create_run(
    uri: str, experiment: str, run_name: str | None, params: dict[str, Any], artifacts: str | None = None
) -> str:
    """The experiment (created if missing, also by a concurrent run, with its artifacts at `artifacts`) and a
    new run with `params`."""
    from mlflow.entities import Param
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        with suppress(MlflowException):  # created meanwhile by another run on the same server
            client.create_experiment(experiment, artifact_location=artifacts)
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            raise MlflowException(f"experiment {experiment!r} could not be created")
    elif artifacts and exp.artifact_location.rstrip("/") != artifacts.rstrip("/"):
        log.warning(
            "MLflow experiment %r keeps its artifacts at %s (fixed when it was created), not %s: give this run "
            "another tracking.experiment to have them there",
            experiment,
            exp.artifact_location,
            artifacts,
        )
    run = client.create_run(exp.experiment_id, run_name=run_name or None)
    items = [Param(k, str(v)[:6000]) for k, v in params.items()]
    for i in range(0, len(items), 100):
        client.log_batch(run.info.run_id, params=items[i : i + 100])
    return run.info.run_id


def reopen_run(uri: str, run_id: str, params: dict[str, Any]) -> bool:
    """Continue MLflow run `run_id`: status RUNNING, the params it lacks logged, the ones whose value changed
    in the tag `relay.params_changed` (MLflow refuses to change a logged param). False where the store has no
    such live run (deleted, or another store): the caller creates a new one."""
    from mlflow.entities import Param, RunTag
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    try:
        run = client.get_run(run_id)
    except MlflowException:
        return False
    if run.info.lifecycle_stage != "active":
        return False
    client.update_run(run_id, status="RUNNING")
    old = run.data.params
    new = [Param(k, str(v)[:6000]) for k, v in params.items() if k not in old]
    for i in range(0, len(new), 100):
        client.log_batch(run_id, params=new[i : i + 100])
    changed = {k: str(v)[:6000] for k, v in params.items() if k in old and old[k] != str(v)[:6000]}
    if changed:
        client.log_batch(run_id, tags=[RunTag("relay.params_changed", json.dumps(changed)[:8000])])
    return True


def read_record(run_dir: Path) -> dict[str, Any]:
    """The run folder's `tracking.json` ({} where it has none or it does not parse)."""
    try:
        got = json.loads((Path(run_dir) / RUN_RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def write_record(run_dir: Path, record: dict[str, Any]) -> None:
    path = Path(run_dir) / RUN_RECORD
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)
