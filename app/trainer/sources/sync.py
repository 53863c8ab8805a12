"""`sync`: batch t is generated with weights t, trained, then t+1 is pushed."""

from __future__ import annotations

from typing import Any

from app.records import Batch
from app.trainer.comm import Actors
from app.trainer.sources.base import RolloutSource


class SyncSource(RolloutSource):
    def __init__(self, cfg: Any, actors: Actors) -> None:
        super().__init__(cfg, actors)
        self.first: Any = None  # the first batch's generation, started by `start` (weights as pushed)

    def start(self, more: bool) -> None:
        if more:
            self.first = self.rollouter.generate_batch.remote(self.groups)

    def next_batch(self, version: int, more: bool) -> Batch:
        ref = self.first if self.first is not None else self.rollouter.generate_batch.remote(self.groups)
        self.first = None
        return self.actors.get(ref, f"the rollout batch for version {version}")
