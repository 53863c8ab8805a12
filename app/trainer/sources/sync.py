"""`sync`: batch t is generated with weights t, trained, then t+1 is pushed."""

from __future__ import annotations

from app.records import Batch
from app.trainer.sources.base import RolloutSource


class SyncSource(RolloutSource):
    def next_batch(self, version: int, more: bool) -> Batch:
        ref = self.rollouter.generate_batch.remote(self.groups)
        return self.actors.get(ref, f"the rollout batch for version {version}")
