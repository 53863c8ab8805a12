"""Every private, experimental or unstable Ray API Relay uses, in one place (pinned: Ray 2.60).

A Ray upgrade that moves one of these is fixed here alone. Each function names what it wraps:

    progress_bar              ray.experimental.tqdm_ray.tqdm (experimental): a progress bar that Ray
                              relays from a worker to the driver's terminal without garbling it
    validate_cluster_config   ray.autoscaler._private.util.fillout_defaults / validate_config (private):
                              what `ray up` checks in a cluster YAML
    replica_id                ray.serve.get_replica_context().replica_id.unique_id (beta API; the
                              `ReplicaID.unique_id` attribute is not documented)
    deploy_app                ray.serve.run_many (developer API): start deploying an application without
                              waiting for its replicas (serve.run has no public way not to wait); through
                              while_serve_starts: Serve's controller created by two drivers at once
    delete_app                ray.serve.delete(_blocking=...) (private argument): delete an application,
                              waiting for its replicas' graceful shutdown or not; through
                              ray.serve.context._get_global_client (private): nothing where Serve never ran
    start_serve_without_proxy ray.serve.context._get_global_client (private): Serve started without
                              HTTP proxies only where it does not run yet
    serve_http_port           ray.serve.context._get_global_client().http_config (private): the port
                              Serve's HTTP proxies listen on (fixed when Serve started on the cluster)
    without_pg_cleaner        DataParallelTrainer._create_default_callbacks (private) and Ray Train's
                              PlacementGroupCleanerCallback (internal): a trainer without the cleaner
    job_config                ray.job_config.JobConfig._py_driver_sys_path and _get_proto_job_config
                              (private): the folders every worker of the job puts first on its sys.path
    job_driver_paths          ray._private.worker.global_worker (private): those folders of the job this
                              driver joined

Nothing else in app/ may import `ray._private`, `ray.experimental`, `ray.llm._internal`, `ray.serve._private`
or any other `_internal`/`_private` Ray module. Ray is imported inside each function: importing this module
costs nothing.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class _NoBar:
    """What `progress_bar` gives where no bar is drawn: the same methods, doing nothing."""

    def update(self, n: float = 1) -> None: ...

    def set_description(self, desc: str) -> None: ...

    def close(self) -> None: ...


def progress_bar(total: int, desc: str) -> Any:
    """A tqdm-like bar (`update(n)`, `set_description`, `close()`) that Ray draws on the driver from inside a
    worker; none where $TQDM_DISABLE is set (the driver sets it when stderr is no terminal, and passes it to
    the workers): Ray's relayed bar ignores that variable and would be redrawn into every log line."""
    import os

    if os.environ.get("TQDM_DISABLE", "").strip().lower() not in ("", "0", "false"):
        return _NoBar()
    from ray.experimental.tqdm_ray import tqdm

    return tqdm(total=total, desc=desc)


def validate_cluster_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Fill in Ray's defaults and validate a cluster YAML (as a dict) as `ray up` would; returns the filled
    config, raises on an invalid one."""
    from ray.autoscaler._private.util import fillout_defaults, validate_config

    filled = fillout_defaults(cfg)
    validate_config(filled)
    return filled


def replica_id() -> str:
    """This Serve replica's unique id (call inside a replica)."""
    from ray import serve

    return serve.get_replica_context().replica_id.unique_id


def deploy_app(
    app: Any, name: str, external_scaler_enabled: bool = False, route_prefix: str | None = None
) -> None:
    """Start deploying the Serve application `app` as `name` (an HTTP route only with `route_prefix`) and
    return once its deployment exists, without waiting for its replicas to start; `serve.status()` then
    tells how the start goes."""
    from ray import serve
    from ray.serve.api import RunTarget

    target = RunTarget(
        target=app, name=name, route_prefix=route_prefix, external_scaler_enabled=external_scaler_enabled
    )
    while_serve_starts(lambda: serve.run_many([target], wait_for_applications_running=False))


def start_serve_without_proxy() -> bool:
    """Start Serve without HTTP proxies (`ProxyLocation.Disabled`: callers use deployment handles) unless it
    runs already (then nothing changes); True where this call started it."""
    from ray import serve
    from ray.serve.context import _get_global_client

    if _get_global_client(raise_if_no_controller_running=False) is not None:
        return False
    while_serve_starts(lambda: serve.start(proxy_location="Disabled"))
    return True


def while_serve_starts(call: Callable[[], T], timeout_s: float = 60.0) -> T:
    """`call()` (a Serve API call that starts Serve's controller when none runs), again while another driver
    is creating that controller: two runs started at once on a fresh cluster both try to create it, and
    the second gets `ActorAlreadyExistsError` (SERVE_CONTROLLER_ACTOR) instead of connecting to it."""
    from ray.exceptions import ActorAlreadyExistsError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except ActorAlreadyExistsError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def delete_app(name: str, wait: bool) -> None:
    """Delete Serve application `name`; with `wait`, return once its replicas stopped (Serve's deadline: 60 s),
    else leave stopping them to Serve's controller. Nothing where Serve does not run (a run that failed
    before deploying): `serve.delete` would raise."""
    from ray import serve
    from ray.serve.context import _get_global_client

    if _get_global_client(raise_if_no_controller_running=False) is None:
        return
    serve_log = logging.getLogger("ray.serve")  # its INFO "Deleting app [...]" is shutdown narration
    level = serve_log.level
    serve_log.setLevel(max(level, logging.WARNING))
    try:
        serve.delete(name, _blocking=wait)
    finally:
        serve_log.setLevel(level)


def serve_http_port() -> int:
    """The port of Serve's HTTP proxies on this cluster (Serve must be running: `serve.start`)."""
    from ray.serve.context import _get_global_client

    return int(_get_global_client().http_config.port)


def current_actor() -> Any:
    """The handle of the actor this code runs in (None outside an actor). Never starts or joins a cluster:
    outside Ray, `get_runtime_context()` would auto-initialise one (and hang on a stale cluster's address)."""
    import ray

    if not ray.is_initialized():
        return None
    try:
        return ray.get_runtime_context().current_actor
    except Exception:
        return None


async def actor_died(handle: Any, timeout_s: float = 2.0) -> bool:
    """True when Ray says the actor `handle` died (its process was killed or crashed). A live actor answers
    its built-in readiness call at once; a busy, restarting or unreachable one within `timeout_s` is not
    called dead (its push deadline still decides)."""
    import asyncio

    from ray.exceptions import ActorDiedError

    try:
        await asyncio.wait_for(handle.__ray_ready__.remote(), timeout=timeout_s)
    except ActorDiedError:
        return True
    except Exception:
        return False
    return False


def forget_stale_cluster_address(record: str | None = None, connect_timeout_s: float = 1.0) -> str | None:
    """Remove Ray's record of the machine's latest `ray start` cluster (`record`, default
    `ray_current_cluster` in Ray's temp folder) when nothing answers at its address any more, as `ray stop`
    would have; returns the address forgotten (None: no record, or a live one). Ray's own address-less
    state queries follow that record, even in a cluster started with `ray.init(address="local")`: Ray
    Train's placement-group cleaner sent every run's controller check to a dead GCS (a traceback in the log,
    no cleanup) after a `ray start --block` had been stopped by a signal."""
    import contextlib
    import socket

    if record is None:
        from ray._common.utils import get_ray_address_file

        record = get_ray_address_file(None)
    try:
        with open(record) as f:
            address = f.read().strip()
    except OSError:
        return None
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=connect_timeout_s):
            return None
    except (OSError, ValueError):
        with contextlib.suppress(FileNotFoundError):
            os.remove(record)
        return address


def without_pg_cleaner(trainer: Any) -> Any:
    """`trainer` (a Ray Train v2 TorchTrainer) without Ray Train's placement-group cleaner, for a cluster the
    run starts and stops itself. The cleaner is a detached actor that removes the workers' placement group
    once it finds the Train controller dead, asking Ray's state API every few seconds; on a loaded machine an
    answer that lacks the controller reads as dead, and the cleaner removed the group of a live run right after
    its last step (the run failed with "Destroying worker since its placement group was removed"). A cluster
    the run owns goes down with the run, its placement groups with it: nothing is left for the cleaner."""
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    make = trainer._create_default_callbacks

    def callbacks() -> list[Any]:
        return [c for c in make() if not isinstance(c, PlacementGroupCleanerCallback)]

    trainer._create_default_callbacks = callbacks
    return trainer


def job_config(order: Callable[[list[str]], list[str]]) -> Any:
    """A `ray.job_config.JobConfig` for `ray.init` whose driver paths pass through `order` when Ray sends the
    config to the cluster. Ray (`ray._private.worker.connect`) appends the driver's script folder and working
    directory to `_py_driver_sys_path` just before it serializes the config; each worker inserts them at the
    front of its `sys.path`, one by one, before its first task (app/infra/import_path.py)."""
    from ray.job_config import JobConfig

    class _OrderedPaths(JobConfig):
        def _get_proto_job_config(self) -> Any:
            if self._cached_pb is None:
                self._py_driver_sys_path = order(list(self._py_driver_sys_path))
            return super()._get_proto_job_config()

    return _OrderedPaths()


def job_driver_paths() -> list[str]:
    """The driver paths (`job_config`) of the job this process is the driver of (Ray must be initialized)."""
    import ray

    return list(ray._private.worker.global_worker.core_worker.get_job_config().py_driver_sys_path)
