"""`BatchSource`: where the trainer's batches come from, and everything that differs between modes.

The loop calls these methods in this order each step (rank 0 except `should_push`, which every rank calls:
the push is collective):

    next_batch(version, more) -> train -> before_push() -> should_push(step, last) -> on_push(version)
    -> validate(...)

`start` runs once after the initial push and validation, `stop` once at the end; `snapshot`/`restore` save and
restore the rollout pipeline with the checkpoint.
"""

from __future__ import annotations

from typing import Any, Protocol

from app.records import Batch, PipelineSnapshot
from app.trainer.comm import Actors
from app.trainer.validation import Validator


class BatchSource(Protocol):
    # the optional metric families (app/trainer/step_metrics.py FAMILIES) that mean something in this mode
    metric_families: frozenset[str]

    def start(self, more: bool) -> None:
        """Once, before the loop; `more`: the loop trains at least one step (not so for a run restored at its
        last step). Where a mode generates batch by batch, the first batch starts generating here, so it
        overlaps the trainer's warm-up (app/trainer/warm_up.py)."""
        ...

    def next_batch(self, version: int, more: bool) -> Batch:
        """The batch to train weights `version` on; `more`: whether another will be asked for after it."""
        ...

    def ack(self, batch: Batch) -> None: ...

    def before_push(self) -> None: ...

    def should_push(self, step: int, last: bool) -> bool:
        """Whether to push after `step` (1-based) trained; `last`: the run ends after this step."""
        ...

    def on_push(self, version: int) -> None: ...

    def validate(self, val: Validator, step: int, version: int, pushed: int, last: bool) -> float | None:
        """Validate after `step` as this mode does; the reward if one was logged now, else None."""
        ...

    def stop(self, val: Validator, step: int) -> float | None: ...

    def snapshot(self, freeze: bool) -> PipelineSnapshot: ...

    def restore(self, snap: PipelineSnapshot) -> dict[str, int]: ...


class RolloutSource:
    """What every mode shares: batches come from the rollouter actor; every step pushes; validation runs
    on the replicas every `algorithm.val_every` steps and at the last, blocking the step."""

    metric_families: frozenset[str] = frozenset()  # sync: nothing overlaps, no push lands mid-generation

    def __init__(self, cfg: Any, actors: Actors) -> None:
        self.cfg, self.actors = cfg, actors
        self.rollouter = actors.rollouter
        self.groups = cfg.train.batch_groups

    def start(self, more: bool) -> None:
        return None

    def next_batch(self, version: int, more: bool) -> Batch:
        raise NotImplementedError

    def ack(self, batch: Batch) -> None:
        """The groups of `batch` are trained (and those dynamic sampling dropped for it are settled): they
        leave the checkpoint state."""
        self.rollouter.ack.remote([g.key for g in batch.groups] + [f.key for f in batch.filtered])

    def before_push(self) -> None:
        return None

    def should_push(self, step: int, last: bool) -> bool:
        return True

    def on_push(self, version: int) -> None:
        return None

    def validate(self, val: Validator, step: int, version: int, pushed: int, last: bool) -> float | None:
        if step % self.cfg.algorithm.val_every == 0 or last:
            return val.run(version, step)
        return None

    def stop(self, val: Validator, step: int) -> float | None:
        return None

    def snapshot(self, freeze: bool) -> PipelineSnapshot:
        """The rollout pipeline now; `freeze` first ends the generations in flight as partial rollouts."""
        import ray

        t = self.cfg.sync.timeout_s
        return ray.get(self.rollouter.snapshot.remote(freeze, t), timeout=t + 60)

    def restore(self, snap: PipelineSnapshot) -> dict[str, int]:
        import ray

        return ray.get(self.rollouter.restore.remote(snap), timeout=120)
