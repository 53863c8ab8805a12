"""What the loop benches (async_speedup, async_learning, reward_overlap) set up in their own process before their
runs: a fresh output folder and a local Ray cluster (as `app.driver.start_ray` starts one for a run)."""

from __future__ import annotations

import time
from pathlib import Path


def fresh_out_dir(root: str) -> Path:
    """A new folder under `root`, named for this moment: runs never mix."""
    out = Path(root).resolve() / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    return out


def start_local_ray(num_cpus: int = 16, env: dict[str, str] | None = None) -> None:
    """A fresh local cluster, without the dashboard or the workers' logs on this console. Roles that asked
    for no GPU see none (`RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO`), as in a run; `env` adds to every worker's."""
    import ray

    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "1", **(env or {})}},
    )
