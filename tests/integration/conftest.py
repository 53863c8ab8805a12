"""One local Ray cluster and one set of vLLM CPU replicas, shared by every integration test.

Every process a test starts is stopped by id at the end of the session: the Ray cluster (ray.shutdown), the
Serve replicas (serve.shutdown), and any vLLM engine process a replica left behind (by pid).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from app.infra.ray_compat import forget_stale_cluster_address

REPO = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(items):
    for item in items:
        if "integration" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


def train_cmd(
    ray_cluster: dict, cache_dir: Path, tmp_path: Path, name: str, *overrides: str, config: str = "quick"
) -> list[str]:
    """`python -m app train --config <config>` on the shared cluster, run `name` under `tmp_path`."""
    return [
        sys.executable,
        "-m",
        "app",
        "train",
        "--config",
        config,
        *overrides,
        f"ray.address={ray_cluster['address']}",
        f"ray.name={name}",
        f"run_dir={tmp_path}",
        f"model.cache_dir={cache_dir}",
        f"tracking.run_name={name}",
    ]


def hub_status(name: str) -> dict:
    """The weight hub's status of run `name` (raises while the run has not created it yet)."""
    import ray

    from app.names import NAMESPACE, hub_name

    return ray.get(ray.get_actor(hub_name(name), namespace=NAMESPACE).status.remote(), timeout=10)


def wait_for(
    what: str, fn: Callable[[], Any], proc: subprocess.Popen, log: Path, timeout: float = 400
) -> Any:
    """Poll `fn` until it returns something truthy, failing if the run `proc` ends or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended while waiting for {what}: {log.read_text()[-4000:]}")
        try:
            got = fn()
        except Exception:  # the run's actors are not up yet
            got = None
        if got:
            return got
        time.sleep(1.0)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


NODE_GRACE_S = 5.0
"""How long a `ray start --block` node gets to stop on SIGTERM before it is killed: its own graceful stop took
35 s on 2 cores (waiting on its workers), with nothing in a test cluster left to save at its end."""


def _running(pid: int) -> bool:
    """The process lives (a zombie, dead but not yet reaped by its parent, does not count)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stop_nodes(nodes: list[subprocess.Popen], grace_s: float = NODE_GRACE_S) -> None:
    """Stop `ray start --block` nodes (each started in a process group of its own) and every process under
    them, by pid: SIGTERM to the groups, then after `grace_s` SIGKILL to the groups and to every descendant
    still alive (Ray's workers and vLLM's engine processes sit in sessions of their own and may outlive their
    raylet)."""
    import psutil

    pids: set[int] = set()
    for node in nodes:
        with contextlib.suppress(psutil.NoSuchProcess):
            pids.update(p.pid for p in psutil.Process(node.pid).children(recursive=True))
    for node in reversed(nodes):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.pid, signal.SIGTERM)  # `ray start --block` stops its node on SIGTERM
    deadline = time.monotonic() + grace_s
    for node in nodes:
        try:
            node.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
            node.wait(timeout=30)
    for pid in pids:
        if _running(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    forget_stale_cluster_address()  # stopped by a signal, the head left its record (`ray stop` would not)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("relay-cache")


@pytest.fixture(scope="session")
def ray_cluster():
    """A Ray head started with the `ray` CLI (as a child process this session owns), and this process as its
    driver. Jobs (`ray job submit`) and CLI runs (`python -m app train ray.address=...`) join it too."""
    import ray

    from app.weights.group import free_port

    bin_dir = Path(sys.executable).parent
    # Ray 2.60 turns token authentication on for new clusters; this throwaway loopback test cluster runs
    # without it (the head, this driver and every job or CLI run the tests start inherit os.environ)
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE",)}
    os.environ["RAY_AUTH_MODE"] = "disabled"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
    }
    port, dash = free_port(), free_port()
    head = subprocess.Popen(
        [
            str(bin_dir / "ray"),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            f"--dashboard-port={dash}",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            "--num-cpus=16",
            "--disable-usage-stats",
        ],
        env=env,
        cwd=REPO,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    leftovers: list[int] = []
    try:
        deadline = time.monotonic() + 40
        while True:
            try:
                ray.init(
                    address=f"127.0.0.1:{port}",
                    runtime_env={
                        "env_vars": {
                            k: env[k] for k in ("PYTHONPATH", "TOKENIZERS_PARALLELISM", "PYTHONUNBUFFERED")
                        }
                    },
                    log_to_driver=False,
                )
                break
            except Exception as e:
                if head.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the Ray head did not start (exit code {head.poll()}): {e}") from e
                time.sleep(2)
        yield {
            "address": f"127.0.0.1:{port}",
            "dashboard": f"http://127.0.0.1:{dash}",
            "env": env,
            "leftover_pids": leftovers,
        }
    finally:
        from ray import serve

        if ray.is_initialized():  # (else Serve would try to connect anew, and could hang)
            with contextlib.suppress(Exception):
                serve.shutdown()
        ray.shutdown()
        stop_nodes([head])
        for pid in leftovers:  # vLLM engine processes of the replicas, if any outlived them
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def result_of(stdout: str) -> dict:
    """The RESULT record of a CLI run (its one `RESULT {json}` line)."""
    import json

    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, stdout[-2000:]
    return json.loads(lines[0][len("RESULT ") :])


# what Ray, Serve, Ray Train, vLLM and torch print at a clean run's end and read as failures (issue 28): none may
# reach a clean CLI run's log (app/infra/log_filters.py RAY_NOISE, app/driver.py `teardown`); literal markers,
# independent of the filter's patterns
SHUTDOWN_NOISE = (
    "PlacementGroupCleaner",
    "destroy_process_group() was not called",
    "Task ServeController.",
    "killed by `ray.kill`",
    "[shutdown]",
    "PYTHON worker processes have been started",
    "') is stopped.",
    "replica from Deployment(",
    "Deleting app [",
)


# what Ray Train's placement-group cleaner says where one machine hosts two clusters (the shared one and
# test_two_nodes.py's): it connects address-less and takes the newest. Nothing a run on a machine of its own
# prints; the two-node run's log may hold it
TWO_CLUSTERS_NOTICE = "Found multiple active Ray instances"


def assert_quiet(stdout: str, stderr: str, allowed: tuple[str, ...] = ()) -> None:
    """A clean CLI run's output holds none of the SHUTDOWN_NOISE lines (but those holding an `allowed`
    text) and no traceback (unless the output holds an `allowed` text: that notice may come with one)."""
    text = stdout + stderr
    noise = [
        ln
        for ln in text.splitlines()
        if any(m in ln for m in SHUTDOWN_NOISE) and not any(a in ln for a in allowed)
    ]
    assert not noise, f"{len(noise)} shutdown-noise lines in a clean run's log:\n" + "\n".join(noise[:20])
    at = text.find("Traceback (most recent call last)")
    assert at < 0 or any(a in text for a in allowed), (
        f"a traceback in a clean run's log:\n{text[at : at + 3000]}"
    )


@pytest.fixture(scope="session")
def async_keep_run(ray_cluster, cache_dir, tmp_path_factory) -> dict:
    """The fully_async `rollout.partial=keep` run of tests/integration/test_async.py (20 prompts, one epoch,
    validation at every step with eval.val_n=2, eval.k=[1,2], algorithm.val_temperature=1.0), finished: its
    RESULT record with `uids`, `dir` (its folder: config.yaml, final/, a checkpoint) and `seconds`. One CLI run
    serves that test and test_eval.py's (a trained final checkpoint, validation with two samples a prompt)."""
    from tests.integration.test_async import EVAL_VALIDATION, async_run

    root = tmp_path_factory.mktemp("async-keep")
    return async_run(
        ray_cluster, cache_dir, root, "keep", "decoupled", 1.0, "train", "train.workers=2", *EVAL_VALIDATION
    )


@pytest.fixture(scope="session")
def async_off_two_nodes_run(ray_cluster, cache_dir, tmp_path_factory) -> dict:
    """The fully_async `rollout.partial=off` run of tests/integration/test_async.py (one trainer rank), on a
    cluster of two Ray nodes of its own (tests/integration/test_two_nodes.py: the replica pinned to the head,
    the trainer to the second node, every push across nodes), finished and its cluster stopped: its RESULT
    record with `uids`, `dir` and `seconds`, and `cluster_s` (the two nodes' start). One CLI run serves
    both tests: the partial=off run needs no more than one node, the two-node run no particular mode."""
    from tests.integration.test_async import async_run
    from tests.integration.test_two_nodes import PLACEMENT, two_node_cluster

    root = tmp_path_factory.mktemp("async-off")
    with two_node_cluster(ray_cluster) as (address, env, started_s):
        res = async_run(
            {"address": address},
            cache_dir,
            root,
            "off",
            "none",
            2.0,
            "regenerate",
            "train.workers=1",  # one trainer rank, on the train node: these runs are about the rollout
            *PLACEMENT,
            env=env,
            # Ray Train's placement-group cleaner polls the state API, which two clusters on one loaded
            # machine answer late: its warning (at times cut in two by Ray's log streaming) may come
            quiet_allowed=(TWO_CLUSTERS_NOTICE, "PlacementGroupCleaner"),
        )
    return {**res, "cluster_s": started_s}


@pytest.fixture(scope="session")
def rollout_stack(ray_cluster, cache_dir):
    """A Serve rollout app (1 vLLM CPU replica), its weight hub and a rollouter, named 'it'; Serve's HTTP
    proxy listens on 127.0.0.1:`http_port`."""
    import ray
    from ray import serve

    from app.agent.openai_api import start_http
    from app.config import load_config, to_container
    from app.driver import resolve_inputs, teardown
    from app.names import NAMESPACE, app_name, rollouter_name
    from app.rollout.rollouter import Rollouter
    from app.serve_rollout import build_app
    from app.weights.actors import start_sync_actors

    cfg = load_config("quick", ["ray.name=it", f"model.cache_dir={cache_dir}", "sync.timeout_s=30"])
    inputs = resolve_inputs(cfg)
    hub, _control = start_sync_actors("it")  # the weight hub and the run control, as the driver makes them
    # Serve's HTTP proxy (the OpenAI endpoint's) on a free loopback port, never the default 8000
    http_port = start_http(0)
    handle = serve.run(build_app(cfg, inputs.model_path), name=app_name("it"), route_prefix=None)
    rollouter = (
        ray.remote(Rollouter)
        .options(name=rollouter_name("it"), namespace=NAMESPACE, num_cpus=0, max_concurrency=64)
        .remote(to_container(cfg), inputs.model_path, inputs.train, inputs.val)
    )
    ray.get([rollouter.progress.remote(), hub.status.remote()], timeout=300)
    info = handle.info.remote().result(timeout_s=60)
    ray_cluster["leftover_pids"].extend(info["child_pids"])
    try:
        yield {
            "cfg": cfg,
            "inputs": inputs,
            "hub": hub,
            "handle": handle,
            "rollouter": rollouter,
            "http_port": http_port,
        }
    finally:
        # (were this process no longer connected, Serve's calls would try to connect anew and hang; the
        # cluster's own teardown stops everything then)
        if ray.is_initialized():
            teardown(cfg, started=False)
