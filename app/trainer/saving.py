"""One checkpoint of the whole pipeline, through Ray Train (layout: app/trainer/checkpoint.py)."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from app.records import PipelineSnapshot
from app.trainer import checkpoint, resume_check
from app.trainer.comm import bcast
from app.trainer.parts import Trainer
from app.trainer.state import RunState

log = logging.getLogger("app.train")


def save_checkpoint(
    t: Trainer, st: RunState, freeze: bool, metrics: dict[str, Any], snap: PipelineSnapshot | None = None
) -> str:
    """Every rank writes its shard; rank 0 adds the counters and the rollout pipeline (`snap`, else a new
    snapshot, frozen first if `freeze`). Collective; returns the checkpoint's directory name."""
    import ray.train

    t.monitor.phase(f"saving the checkpoint of step {st.step}")
    t0 = time.perf_counter()
    if t.lead and snap is None:
        snap = t.source.snapshot(freeze)
    tmp = Path(tempfile.mkdtemp(prefix=f"relay-ckpt-r{t.rank}-"))
    try:
        state = st.to_dict(t.cfg.algorithm.mode, t.learner.world)
        pipeline = snap.to_dict() if snap is not None else None
        files = checkpoint.save(t.learner, tmp, t.rank, state, pipeline, _identity(t) if t.lead else None)
        name = bcast(f"step_{st.step:06d}_{int(time.time() * 1000)}")
        ray.train.report(
            metrics, checkpoint=ray.train.Checkpoint.from_directory(str(tmp)), checkpoint_dir_name=name
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _seal(t, name, files, st.step)
    if t.lead:
        _log_saved(t, st.step, snap, time.perf_counter() - t0)
    return name


def _identity(t: Trainer) -> dict[str, Any] | None:
    """The run's identity (written by the driver into the run folder) that the checkpoint keeps as
    config.json, for `--resume` to compare with (app/trainer/resume_check.py)."""
    path = t.run_dir / resume_check.IDENTITY
    return json.loads(path.read_text()) if path.exists() else None


def _seal(t: Trainer, name: str, files: dict[str, dict[str, Any]], step: int) -> None:
    """Once every rank's part is in the run's storage (`ray.train.report` returned on every rank: the
    all-gather waits for them), rank 0 writes the manifest of all of them, last (app/trainer/checkpoint.py)."""
    import ray.train
    import torch.distributed as dist

    parts = [files]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, files)
    if not t.lead:
        return
    persisted = ray.train.get_checkpoint()  # the checkpoint just reported, in the run's storage
    path = Path(persisted.path) if persisted is not None else None
    if path is None or path.name != name:  # Ray Train skipped the report (a worker failed meanwhile)
        log.warning(
            "checkpoint %s was not persisted (Ray Train's latest is %s): left without a manifest", name, path
        )
        return
    checkpoint.write_manifest(path, {k: v for part in parts for k, v in part.items()}, step)


def _log_saved(t: Trainer, step: int, snap: PipelineSnapshot, seconds: float) -> None:
    t.tracker.metrics(
        {
            "ckpt/save_s": seconds,
            "ckpt/queued_groups": len(snap.ready),
            "ckpt/pending_prompts": len(snap.pending),
            "ckpt/partial_groups": snap.partial_groups,
            "ckpt/partial_tokens": snap.partial_tokens,
        },
        step,
    )
    log.info(
        "checkpoint of step %d saved in %.2fs: %d queued groups, %d prompts in flight (%d partial)",
        step,
        seconds,
        len(snap.ready),
        len(snap.pending),
        snap.partial_groups,
    )
