"""`one_step_off`: batch t+1 is generated (with weights t) while batch t trains. The push of t+1 waits for
that generation to finish, so it never lands mid-generation and every trained token is exactly one version
old (the first batch excepted)."""

from __future__ import annotations

from typing import Any

from app.records import Batch
from app.trainer.comm import Actors
from app.trainer.sources.base import RolloutSource


class OneStepOffSource(RolloutSource):
    metric_families = frozenset({"overlap"})  # generation overlaps training; every token exactly 1 old

    def __init__(self, cfg: Any, actors: Actors) -> None:
        super().__init__(cfg, actors)
        self.pending: Any = None  # the generation of the next batch, started before this one trains

    def next_batch(self, version: int, more: bool) -> Batch:
        if self.pending is None:
            self.pending = self.rollouter.generate_batch.remote(self.groups)
        batch = self.actors.get(self.pending, f"the rollout batch for version {version}")
        self.pending = self.rollouter.generate_batch.remote(self.groups) if more else None
        return batch

    def before_push(self) -> None:
        import ray

        if self.pending is not None:  # the push must not land in the middle of generation t+1
            ray.wait([self.pending], timeout=self.actors.timeout_s)
