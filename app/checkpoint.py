"""Checkpoints of the whole pipeline, saved through Ray Train.

One checkpoint directory holds:

    model/          the sharded model and optimizer (torch.distributed.checkpoint: one file per rank plus
                    the metadata rank 0 writes); loads onto any FSDP2 layout of the same model
    rank{r}.pt      each rank's learning-rate scheduler and RNG states
    state.json      the trainer's counters: weight version, step, validation, skipped steps
    pipeline.json   the rollouter's snapshot: stream position, finished groups not yet trained, and the other
                    prompts taken from the stream with their partial rollouts (app/rollouter.py)

Every rank writes its part into a local directory and reports it with `ray.train.report`; Ray Train merges
them into one directory under the run's storage (`<run_dir>/ray_train/...`), which `ray.train.get_checkpoint()`
returns after a worker failure and `python -m app train --resume PATH` names explicitly.
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

STATE = "state.json"
PIPELINE = "pipeline.json"


def save(learner: Any, path: Path, rank: int, state: dict[str, Any], pipeline: dict[str, Any] | None) -> None:
    """Write this rank's part of a checkpoint into `path` (collective over the trainer ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path.mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = get_state_dict(learner.model, learner.opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "model"))
    torch.save(
        {
            "sched": learner.sched.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "py_rng": random.getstate(),
        },
        path / f"rank{rank}.pt",
    )
    if rank == 0:
        (path / STATE).write_text(json.dumps({**state, "saved_at": time.time()}))
        if pipeline is not None:
            (path / PIPELINE).write_text(json.dumps(pipeline))


def load(learner: Any, path: Path, rank: int) -> dict[str, Any]:
    """Load model, optimizer, scheduler and RNG states into this rank; returns state.json (and pipeline)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(learner.model, learner.opt)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=str(path / "model"))
    set_state_dict(learner.model, learner.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    mine = path / f"rank{rank}.pt"
    if not mine.exists():  # resumed on more workers than saved it: the shards reshard, RNGs come from rank 0
        log.warning("%s has no state for rank %d (saved with fewer workers): using rank 0's", path, rank)
        mine = path / "rank0.pt"
    extra = torch.load(mine, weights_only=False)
    learner.sched.load_state_dict(extra["sched"])
    torch.set_rng_state(extra["torch_rng"])
    if extra.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(extra["cuda_rng"])
    random.setstate(extra["py_rng"])
    state = json.loads((path / STATE).read_text())
    pipe = path / PIPELINE
    state["pipeline"] = json.loads(pipe.read_text()) if pipe.exists() else None
    return state


def find(path: str | Path) -> Path:
    """A checkpoint directory from what a user gives `--resume`: the directory itself, or a run directory
    (or any folder above checkpoints), whose newest checkpoint is taken. Raises FileNotFoundError."""
    p = Path(path).expanduser().resolve()
    if (p / STATE).exists():
        return p
    if not p.exists():
        raise FileNotFoundError(f"--resume {path}: no such file or directory")
    found = sorted(
        (json.loads(s.read_text()).get("step", 0), s.stat().st_mtime, s.parent) for s in p.rglob(STATE)
    )
    if not found:
        raise FileNotFoundError(
            f"--resume {path}: no checkpoint in it (no {STATE} below it); give a run directory or one of "
            "its checkpoints (they are saved every train.save_every steps and when a run stops)"
        )
    return found[-1][2]


def complete(path: Path) -> bool:
    """Whether every rank's part of a checkpoint is there (Ray Train copies ranks' parts one by one)."""
    try:
        state = json.loads((path / STATE).read_text())
    except (OSError, ValueError):
        return False
    world = int(state.get("world", 1))
    return (path / "model" / ".metadata").exists() and all(
        (path / f"rank{r}.pt").exists() for r in range(world)
    )


def newest(root: Path) -> tuple[int, Path] | None:
    """(step, path) of the newest complete checkpoint below `root`, or None."""
    best: tuple[int, float, Path] | None = None
    for s in root.rglob(STATE) if root.exists() else []:
        if complete(s.parent):
            key = (json.loads(s.read_text()).get("step", 0), s.stat().st_mtime, s.parent)
            best = key if best is None or key[:2] > best[:2] else best
    return (best[0], best[2]) if best else None


def truncate_log(log_path: Path, step: int) -> int:
    """Drop accounting records of steps after `step` (trained by a worker whose work a restore discarded);
    returns how many were dropped."""
    if not log_path.exists():
        return 0
    lines = log_path.read_text().splitlines()
    keep = [x for x in lines if json.loads(x)["step"] <= step]
    log_path.write_text("".join(x + "\n" for x in keep))
    return len(lines) - len(keep)
