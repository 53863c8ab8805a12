"""The local Ray cluster the loop benches start in their own process (as `app.driver.start_ray` does for a run)."""

from __future__ import annotations


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
