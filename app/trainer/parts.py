"""`Trainer`: the pieces one trainer worker runs with, built once by `app.train_loop.train_worker`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.trainer.accounting import TrainedLog
from app.trainer.comm import Actors
from app.trainer.monitor import Monitor
from app.trainer.rollout_log import RolloutLog
from app.trainer.sources import BatchSource
from app.trainer.validation import Validator


@dataclass(kw_only=True)
class Trainer:
    cfg: Any
    rank: int
    learner: Any  # app.trainer.learner.Learner
    sync: Any  # app.sync.TrainerSync
    source: BatchSource
    actors: Actors
    run_dir: Path
    model_path: str
    monitor: Monitor
    accounting: TrainedLog
    rollouts: RolloutLog
    prom: Any  # app.infra.metrics.Metrics
    tracker: Any = None  # rank 0: app.infra.tracking.Tracker
    validator: Validator | None = None  # rank 0
    bar: Any = None  # rank 0: the progress bar, from the loop's start
    between: list = field(default_factory=list)  # PushStats of pushes made while waiting for a batch

    @property
    def lead(self) -> bool:
        """Rank 0: the rank that talks to the other roles and logs."""
        return self.rank == 0
