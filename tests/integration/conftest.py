"""One local Ray cluster and one set of vLLM CPU replicas, shared by every integration test.

Every process a test starts is stopped by id at the end of the session: the Ray cluster (ray.shutdown), the
Serve replicas (serve.shutdown), and any vLLM engine process a replica left behind (by pid).
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(items):
    for item in items:
        if "integration" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("relay-cache")


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    env = {"PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    ctx = ray.init(num_cpus=16, runtime_env={"env_vars": env}, include_dashboard=False, log_to_driver=False)
    leftovers: list[int] = []
    try:
        yield {"address": ctx.address_info["gcs_address"], "leftover_pids": leftovers}
    finally:
        from ray import serve

        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        for pid in leftovers:  # vLLM engine processes of the replicas, if any outlived them
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def rollout_stack(ray_cluster, cache_dir):
    """A Serve rollout app (1 vLLM CPU replica), its weight hub and a rollouter, named 'it'."""
    import ray
    from ray import serve

    from app.config import load_config, to_container
    from app.driver import resolve_inputs, teardown
    from app.rollouter import Rollouter, rollouter_name
    from app.serve_rollout import NAMESPACE, app_name, build_app, hub_name
    from app.sync import WeightHub

    cfg = load_config("quick", ["ray.name=it", f"model.cache_dir={cache_dir}", "sync.timeout_s=30"])
    inputs = resolve_inputs(cfg)
    hub = ray.remote(WeightHub).options(name=hub_name("it"), namespace=NAMESPACE, num_cpus=0).remote()
    handle = serve.run(build_app(cfg, inputs.model_path), name=app_name("it"), route_prefix=None)
    rollouter = (
        ray.remote(Rollouter)
        .options(name=rollouter_name("it"), namespace=NAMESPACE, num_cpus=0, max_concurrency=64)
        .remote(to_container(cfg), inputs.model_path, inputs.train_rows, inputs.val_rows)
    )
    ray.get([rollouter.progress.remote(), hub.status.remote()], timeout=300)
    info = handle.info.remote().result(timeout_s=60)
    ray_cluster["leftover_pids"].extend(info["child_pids"])
    try:
        yield {"cfg": cfg, "inputs": inputs, "hub": hub, "handle": handle, "rollouter": rollouter}
    finally:
        teardown(cfg, started=False)
