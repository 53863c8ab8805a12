"""`RunState`: the trainer's counters (a checkpoint's state.json), and how a run restores or starts them."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from app.records import PipelineSnapshot
from app.trainer import checkpoint, resume_check
from app.trainer.comm import bcast
from app.trainer.parts import Trainer

log = logging.getLogger("app.train")

# the fields of RunState that state.json keeps (the others live for one process only)
PERSISTED = ("version", "step", "val_first", "val_last", "skipped_total", "tokens_trained")


@dataclass(kw_only=True)
class RunState:
    version: int = 0  # the trainer's weights
    step: int = 0  # optimizer steps done
    val_first: float | None = None
    val_last: float | None = None
    skipped_total: int = 0  # steps skipped for a non-finite loss or gradient
    tokens_trained: int = 0
    pushed: int = 0  # the version the replicas hold
    stop: str | None = None  # why the run stops early (a stop request, the data ran out)
    restored_from: dict[str, Any] | None = None
    t_run: float = field(default_factory=time.perf_counter)
    t_loop_end: float = field(default_factory=time.perf_counter)  # end of the last step's push

    def to_dict(self, mode: str, world: int) -> dict[str, Any]:
        """state.json's content."""
        return {**{k: getattr(self, k) for k in PERSISTED}, "mode": mode, "world": world}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunState:
        names = {f.name for f in fields(cls)} & set(PERSISTED)
        st = cls(**{k: v for k, v in d.items() if k in names})
        st.pushed = st.version
        return st


def _choose(t: Trainer, resume: str | None) -> tuple[str | None, bool]:
    """(checkpoint path, restart): what to continue from. After a worker failure (a restart) the newest
    complete checkpoint of this run's storage (damaged ones skipped with a warning), else --resume's; on a
    first start --resume's, which the driver verified and checked against this run's config. Decided by
    rank 0 for every rank."""
    import ray

    choice: dict[str, Any] = {}
    if t.lead:
        restart = ray.get(t.actors.hub.status.remote(), timeout=30)["version"] >= 0  # this run pushed
        path = resume
        if restart and (found := checkpoint.newest(t.run_dir / "ray_train")) is not None:
            found.warn()
            path = str(found.path)
        choice = {"restart": restart, "path": path}
    choice = bcast(choice)
    return choice["path"], choice["restart"]


def restore_or_start(t: Trainer, resume: str | None) -> RunState:
    """The run's state: restored from a checkpoint (model, optimizer, counters, rollout pipeline), or new."""
    path, restart = _choose(t, resume)
    if path:
        return _restore(t, Path(path), restart)
    if restart and t.lead:  # restarted before any checkpoint: start the stream afresh
        t.accounting.truncate(0)
        t.rollouts.truncate(0)
        t.source.restore(PipelineSnapshot())
        log.warning("restarted without a checkpoint: training starts over from version 0")
    return RunState()


def fresh_pipeline(snap: PipelineSnapshot) -> tuple[PipelineSnapshot, dict[str, int]]:
    """The pipeline of a resume onto new data (--resume-with-new-data): the old file's queue dropped (its
    stream position, finished groups and prompts in flight); the counters go on. Returns what was dropped."""
    dropped = {"groups": len(snap.ready), "prompts": len(snap.pending), "partial": snap.partial_groups}
    return PipelineSnapshot(taken=snap.taken, version=snap.version), dropped


def _restore(t: Trainer, ckpt_dir: Path, restart: bool) -> RunState:
    saved = checkpoint.load(t.learner, ckpt_dir, t.rank)
    st = RunState.from_dict(saved)
    st.restored_from = {"path": str(ckpt_dir), "step": st.step, "version": st.version}
    if not t.lead:
        return st
    if restart:  # same run: forget what the failed workers trained after the checkpoint
        dropped = t.accounting.truncate(st.step)
        t.rollouts.truncate(st.step)
        log.warning(
            "restored step %d from %s; %d trained-group records after it dropped", st.step, ckpt_dir, dropped
        )
    snap = PipelineSnapshot.from_dict(saved["pipeline"])
    metrics: dict[str, float] = {"ckpt/restored_step": st.step}
    if resume_check.data_changed(ckpt_dir, t.run_dir):  # allowed by the driver: --resume-with-new-data
        snap, gone = fresh_pipeline(snap)
        st.restored_from["dropped"] = gone
        metrics.update({f"ckpt/dropped_{k}": v for k, v in gone.items()})
        log.warning(
            "new training data: the checkpoint's queue is dropped (%d finished groups, %d prompts in flight, "
            "%d of them partial); the new data starts its first epoch",
            gone["groups"],
            gone["prompts"],
            gone["partial"],
        )
    got = t.source.restore(snap)
    st.restored_from["pipeline"] = got
    t.tracker.metrics({**metrics, "ckpt/restored_partial": got["partial"]}, st.step)
    return st
