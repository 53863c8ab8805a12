"""`one_step_off`: batch t+1 is generated (with weights t) while batch t trains. The push of t+1 waits for
that generation to finish, so it never lands mid-generation and every trained token is exactly one version
old (the first batch excepted). The generation after it starts right after the push, not when the loop next
asks for a batch: the replicas do not idle while the trainer reports the step, validates or checkpoints."""

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
        self.ready: Any = None  # a finished next batch whose successor `on_push` already started
        self.follow_on = False  # whether the loop asks for another batch after the next one

    def start(self, more: bool) -> None:
        if more:  # batch 1, with the weights just pushed
            self.pending = self.rollouter.generate_batch.remote(self.groups)

    def next_batch(self, version: int, more: bool) -> Batch:
        if self.ready is not None:  # its successor went out right after the last push
            ref, self.ready = self.ready, None
            return self.actors.get(ref, f"the rollout batch for version {version}")
        if self.pending is None:
            self.pending = self.rollouter.generate_batch.remote(self.groups)
        batch = self.actors.get(self.pending, f"the rollout batch for version {version}")
        self.pending = self.rollouter.generate_batch.remote(self.groups) if more else None
        return batch

    def before_push(self) -> None:
        import ray

        if self.pending is not None:  # the push must not land in the middle of generation t+1
            ray.wait([self.pending], timeout=self.actors.timeout_s)

    def should_push(self, step: int, last: bool) -> bool:
        # the batch after the next one is wanted where the loop runs two more steps (as `next_batch`'s `more`)
        self.follow_on = not last and step + 1 < self.cfg.train.steps
        return True

    def on_push(self, version: int) -> None:
        """The new weights are on every replica and batch t+1 is generated: start batch t+2 now."""
        if self.follow_on and self.pending is not None and self.ready is None:
            self.ready, self.pending = self.pending, self.rollouter.generate_batch.remote(self.groups)
