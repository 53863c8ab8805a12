"""The Ray Train callback that installs Relay's log filter in Ray Train's controller, a process that runs no
Relay code otherwise.

app/infra/log_filters.py `quiet_ray_noise()` names `ControllerLogFilters` in RAY_TRAIN_CALLBACKS; Ray Train
reads that variable in the driver when the trainer is built (`_initialize_env_callbacks`, Ray 2.60) and the
callback travels, pickled, to the controller with the run. There it installs `CleanerStopFilter` and
`ResourceRequestFilter` (log_filters.py: why a late stop of the placement-group cleaner and a late reply to a
resource request are harmless) as it is unpickled, when the controller actor is built: before any callback
runs (the scaling policy sends its first resource request in its own `after_controller_start`, which may come
first), and again in `after_controller_start`.
`ControllerCallback` is Ray Train's developer API.
"""

from __future__ import annotations

from typing import Any

from ray.train.v2._internal.execution.callback import ControllerCallback

from app.infra.log_filters import quiet_train_controller


class ControllerLogFilters(ControllerCallback):
    """Installs Relay's filters on Ray Train's controller loggers where the controller unpickles it."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _unpickled, ()

    def after_controller_start(self, train_run_context: Any) -> None:
        quiet_train_controller()


def _unpickled() -> ControllerLogFilters:
    """The callback, unpickled in the controller's process: the filters go in at once."""
    quiet_train_controller()
    return ControllerLogFilters()
