"""The weight hub and the run control as named Ray actors of one run (created by the driver)."""

from __future__ import annotations

from typing import Any

from app.names import NAMESPACE, control_name, hub_name
from app.weights.control import RunControl
from app.weights.hub import WeightHub


def start_sync_actors(prefix: str) -> tuple[Any, Any]:
    """Create run `prefix`'s `RunControl` and `WeightHub` actors (names `control_name`, `hub_name`)."""
    import ray

    control = (
        ray.remote(RunControl).options(name=control_name(prefix), namespace=NAMESPACE, num_cpus=0).remote()
    )
    hub = (
        ray.remote(WeightHub).options(name=hub_name(prefix), namespace=NAMESPACE, num_cpus=0).remote(control)
    )
    return hub, control


def get_actor(name: str) -> Any:
    """A named actor of this namespace (raises ValueError when it does not exist)."""
    import ray

    return ray.get_actor(name, namespace=NAMESPACE)
