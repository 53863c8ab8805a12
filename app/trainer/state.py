"""`RunState`: the trainer's counters (a checkpoint's state.json), and how a run restores or starts them."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from app import checkpoint
from app.records import PipelineSnapshot
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


def _choose(t: Trainer, resume: str | None) -> tuple[Any, str | None, bool]:
    """(Ray Train checkpoint, path, restart): a checkpoint to continue from. After a worker failure Ray
    Train's latest, or a newer complete one in this run's storage (one reported just before the failure may
    not have been registered yet); else --resume's. Decided by rank 0 for every rank."""
    import ray
    import ray.train

    ckpt = ray.train.get_checkpoint()
    choice: dict[str, Any] = {}
    if t.lead:
        restart = ray.get(t.actors.hub.status.remote(), timeout=30)["version"] >= 0  # this run pushed
        found = checkpoint.newest(t.run_dir / "ray_train") if restart else None
        if ckpt is not None and found is not None:
            with ckpt.as_directory() as d:
                if json.loads(Path(d, checkpoint.STATE).read_text())["step"] >= found[0]:
                    found = None
        choice = {"restart": restart, "path": str(found[1]) if found else None}
    choice = bcast(choice)
    if choice["path"]:
        return None, choice["path"], choice["restart"]
    return ckpt, None if ckpt is not None else resume, choice["restart"]


def restore_or_start(t: Trainer, resume: str | None) -> RunState:
    """The run's state: restored from a checkpoint (model, optimizer, counters, rollout pipeline), or new."""
    ckpt, path, restart = _choose(t, resume)
    with ckpt.as_directory() if ckpt is not None else contextlib.nullcontext(path) as ckpt_dir:
        if ckpt_dir:
            return _restore(t, Path(ckpt_dir), restart)
    if restart and t.lead:  # restarted before any checkpoint: start the stream afresh
        t.accounting.truncate(0)
        t.source.restore(PipelineSnapshot())
        log.warning("restarted without a checkpoint: training starts over from version 0")
    return RunState()


def _restore(t: Trainer, ckpt_dir: Path, restart: bool) -> RunState:
    saved = checkpoint.load(t.learner, ckpt_dir, t.rank)
    st = RunState.from_dict(saved)
    st.restored_from = {"path": str(ckpt_dir), "step": st.step, "version": st.version}
    if not t.lead:
        return st
    if restart:  # same run: forget what the failed workers trained after the checkpoint
        dropped = t.accounting.truncate(st.step)
        log.warning(
            "restored step %d from %s; %d trained-group records after it dropped", st.step, ckpt_dir, dropped
        )
    pipe = saved.get("pipeline")
    got = t.source.restore(PipelineSnapshot.from_dict(pipe) if pipe else PipelineSnapshot())
    st.restored_from["pipeline"] = got
    t.tracker.metrics({"ckpt/restored_step": st.step, "ckpt/restored_partial": got["partial"]}, st.step)
    return st
