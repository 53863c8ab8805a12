"""`fully_async`: groups stream into the rollouter's bounded queue while the trainer trains; weights are
pushed every `algorithm.sync_every` steps, and validation runs on the replicas beside the stream."""

from __future__ import annotations

from app.records import Batch
from app.trainer.sources.base import RolloutSource
from app.trainer.validation import Validator


class FullyAsyncSource(RolloutSource):
    metric_families = frozenset({"overlap", "partial"})

    def start(self, more: bool) -> None:  # the stream runs whatever `more`
        import ray

        ray.get(self.rollouter.start_stream.remote(), timeout=60)

    def next_batch(self, version: int, more: bool) -> Batch:
        ref = self.rollouter.get_batch.remote(self.groups, version, self.actors.timeout_s)
        # the rollouter's own deadline fires first, with its report
        return self.actors.get(ref, f"{self.groups} finished groups for version {version}", slack=30.0)

    def should_push(self, step: int, last: bool) -> bool:
        return step % self.cfg.algorithm.sync_every == 0 or last

    def on_push(self, version: int) -> None:
        import ray

        ray.get(self.rollouter.on_push.remote(version), timeout=30)

    def validate(self, val: Validator, step: int, version: int, pushed: int, last: bool) -> float | None:
        landed = val.poll(step)
        if last:
            val.drain(step)
            return val.run(version, step)
        if step % self.cfg.algorithm.val_every == 0:
            val.launch(pushed)  # on the weights the replicas hold (a push may be due later)
        return landed

    def stop(self, val: Validator, step: int) -> float | None:
        import ray

        ray.get(self.rollouter.stop_stream.remote(), timeout=30)
        return val.drain(step)
