"""The Ray Train callback that installs Relay's log filter in Ray Train's controller, a process that runs no
Relay code otherwise.

app/infra/log_filters.py `quiet_ray_noise()` names `ControllerLogFilters` in RAY_TRAIN_CALLBACKS; Ray Train
reads that variable in the driver when the trainer is built (`_initialize_env_callbacks`, Ray 2.60) and the
callback travels to the controller with the run. There, before the control loop starts, it installs
`CleanerStopFilter` and `ResourceRequestFilter` (log_filters.py: why a late stop of the placement-group cleaner
and a late reply to a resource request are harmless).
`ControllerCallback` is Ray Train's developer API.
"""

from __future__ import annotations

from typing import Any

from ray.train.v2._internal.execution.callback import ControllerCallback

from app.infra.log_filters import quiet_train_controller


class ControllerLogFilters(ControllerCallback):
    """Installs Relay's filter on Ray Train's controller loggers when the controller starts."""

    def after_controller_start(self, train_run_context: Any) -> None:
        quiet_train_controller()
