"""Checkpoints of the whole pipeline, saved through Ray Train, and verified before they are restored.

One checkpoint directory holds:

    model/          the sharded model and optimizer (torch.distributed.checkpoint: one file per rank plus
                    the metadata rank 0 writes); loads onto any FSDP2 layout of the same model
    rank{r}.pt      each rank's learning-rate scheduler and RNG states
    state.json      the trainer's counters: weight version, step, validation, skipped steps
    pipeline.json   the rollouter's snapshot: stream position, finished groups not yet trained, and the other
                    prompts taken from the stream with their partial rollouts (app/rollout/rollouter.py)
    config.json     what `--resume` compares a new run with: the resolved config, the model's identity and
                    shapes, the prompt files' checksums (app/trainer/resume_check.py)
    manifest.json   written last: every other file with its size and sha256

Every rank writes its part into a local directory, hashes it, and reports it with `ray.train.report`; Ray
Train copies the parts one by one into one directory under the run's storage (`<run_dir>/<run>/ray_train/
<run>/step_...`). Once every rank's copy is done, rank 0 writes the manifest there (a temporary file renamed
into place): a checkpoint is complete only with its manifest, and only while every file matches it.

`select` picks what a restore continues from: the newest complete checkpoint; a damaged newer one (a file
missing, of another size, or failing its checksum) is skipped with a warning naming the file. A checkpoint
written before manifests existed is accepted where every expected file is there and parses, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.errors import UserError

log = logging.getLogger(__name__)

STATE = "state.json"
PIPELINE = "pipeline.json"
CONFIG = "config.json"
MANIFEST = "manifest.json"
FORMAT = 1
REQUIRED = (STATE, PIPELINE, "model/.metadata")  # in every checkpoint, whatever its world size
_CHUNK = 8 << 20
_NAME = re.compile(r"step_(\d+)_(\d+)$")


class CheckpointError(UserError, RuntimeError):
    """No checkpoint that `--resume` (or a restart) can continue from; the message names the damaged files."""


class ResumeError(UserError, FileNotFoundError):
    """`--resume` names no run and no checkpoint; the message says what it does name and what to give."""


@dataclass(frozen=True)
class Damage:
    """One reason a checkpoint is incomplete: `file` (relative to it) is missing, of another size than its
    manifest says, fails its checksum, or does not parse."""

    file: str
    problem: str

    def __str__(self) -> str:
        return f"{self.file}: {self.problem}"


@dataclass
class Selection:
    """The checkpoint to continue from, and the newer ones skipped for damage (newest first)."""

    path: Path
    step: int
    legacy: bool = False  # written before manifests: files checked for presence and parsing only
    skipped: list[tuple[Path, list[Damage]]] = field(default_factory=list)

    def warn(self) -> None:
        """Log one warning per skipped checkpoint and one for a legacy checkpoint."""
        for path, damage in self.skipped:
            log.warning(
                "checkpoint %s is damaged (%s): falling back to the previous complete one, %s (step %d)",
                path,
                "; ".join(map(str, damage)),
                self.path,
                self.step,
            )
        if self.legacy:
            log.warning(
                "checkpoint %s was written before checkpoints had a manifest: its files are there and parse, "
                "but their sizes and checksums cannot be verified",
                self.path,
            )


# ------------------------------------------------------------------ writing


def sha256(path: Path) -> str:
    """The file's sha256, read in chunks (a large shard is never held in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def describe(path: Path) -> dict[str, dict[str, Any]]:
    """{relative path: {"size", "sha256"}} of every file below `path` (hashed in threads: hashlib releases
    the GIL, so shards hash in parallel)."""
    files = sorted(p for p in path.rglob("*") if p.is_file())
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(files)))) as pool:
        sums = list(pool.map(sha256, files))
    return {
        p.relative_to(path).as_posix(): {"size": p.stat().st_size, "sha256": s}
        for p, s in zip(files, sums, strict=True)
    }


def _write_atomic(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file renamed into place (a reader sees all of it or none)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(
    learner: Any,
    path: Path,
    rank: int,
    state: dict[str, Any],
    pipeline: dict[str, Any] | None,
    config: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Write this rank's part of a checkpoint into `path` (collective over the trainer ranks); returns its
    files with sizes and checksums (`describe`), for the manifest. Rank 0 must have the pipeline's snapshot:
    a checkpoint without one would restore as the start of the epoch."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if rank == 0 and pipeline is None:
        raise ValueError("rank 0 saves a checkpoint without the rollout pipeline's snapshot (pipeline.json)")
    path.mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = get_state_dict(learner.model, learner.opt, options=_options(learner))
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
        _write_atomic(path / STATE, json.dumps({**state, "format": FORMAT, "saved_at": time.time()}))
        _write_atomic(path / PIPELINE, json.dumps(pipeline))
        if config is not None:
            _write_atomic(path / CONFIG, json.dumps(config))
    return describe(path)


def write_manifest(path: Path, files: dict[str, dict[str, Any]], step: int) -> None:
    """Rank 0, once every rank's part is in `path`: check each file is there with its size, then write the
    manifest last, atomically. Raises CheckpointError where a part did not arrive whole (the checkpoint
    then stays incomplete, and no restore takes it)."""
    missing = [str(p) for p in _size_damage(path, files)]
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete after the copy: {'; '.join(missing)}")
    manifest = {"format": FORMAT, "step": step, "written_at": time.time(), "files": files}
    _write_atomic(path / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))


# ------------------------------------------------------------------ verifying


def _size_damage(path: Path, files: dict[str, dict[str, Any]]) -> list[Damage]:
    out = []
    for rel, meta in sorted(files.items()):
        p = path / rel
        if not p.is_file():
            out.append(Damage(rel, "missing"))
        elif (size := p.stat().st_size) != meta["size"]:
            out.append(Damage(rel, f"size {size} bytes, the manifest says {meta['size']}"))
    return out


def verify(path: Path, checksums: bool = True) -> list[Damage]:
    """What is wrong with the checkpoint at `path` (empty: complete). With a manifest every file it names must
    be there with its size (and its sha256, where `checksums`); without one (a checkpoint written before
    manifests) every expected file must be there, non-empty, and the JSON files must parse."""
    mf = path / MANIFEST
    if not mf.exists():
        return _verify_legacy(path)
    try:
        manifest = json.loads(mf.read_text())
        files: dict[str, dict[str, Any]] = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [Damage(MANIFEST, f"unreadable ({e})")]
    damage = [Damage(r, "not in the manifest") for r in REQUIRED if r not in files]
    damage += _size_damage(path, files)
    if checksums and not damage:
        names = sorted(files)
        with ThreadPoolExecutor(max_workers=min(8, max(1, len(names)))) as pool:
            got = list(pool.map(lambda r: sha256(path / r), names))
        damage += [
            Damage(
                r, f"checksum mismatch (sha256 {g[:12]}..., the manifest says {files[r]['sha256'][:12]}...)"
            )
            for r, g in zip(names, got, strict=True)
            if g != files[r]["sha256"]
        ]
    return damage


def _verify_legacy(path: Path) -> list[Damage]:
    damage: list[Damage] = []
    state: dict[str, Any] = {}
    for name in (STATE, PIPELINE):
        try:
            parsed = json.loads((path / name).read_text())
            if not isinstance(parsed, dict):
                raise ValueError(f"a JSON {type(parsed).__name__}, not an object")
            state = parsed if name == STATE else state
        except FileNotFoundError:
            damage.append(Damage(name, "missing"))
        except (OSError, ValueError) as e:
            damage.append(Damage(name, f"does not parse ({e})"))
    if state.get("format"):  # written with a manifest: its save never finished (a failure before the seal)
        damage.append(Damage(MANIFEST, "missing: the save did not finish (the manifest is written last)"))
    expected = ["model/.metadata"] + [f"rank{r}.pt" for r in range(int(state.get("world", 1)))]
    model = path / "model"
    found = (
        [p.relative_to(path).as_posix() for p in model.rglob("*") if p.is_file()] if model.is_dir() else []
    )
    for rel in sorted(set(expected) | set(found)):
        p = path / rel
        if not p.is_file():
            damage.append(Damage(rel, "missing"))
        elif p.stat().st_size == 0:
            damage.append(Damage(rel, "empty (0 bytes)"))
    return damage


def _is_checkpoint(p: Path) -> bool:
    """A checkpoint directory: named like one (step_000010_<ms>), or holding a manifest or state.json."""
    return p.is_dir() and bool(_NAME.search(p.name) or (p / MANIFEST).exists() or (p / STATE).exists())


def _order(p: Path) -> tuple[int, float]:
    """(step, time) of a checkpoint: from its name (step_000010_<ms>), which damage cannot hide; else from
    its manifest or state.json, else its modification time."""
    if m := _NAME.search(p.name):
        return int(m.group(1)), int(m.group(2)) / 1000
    for name in (MANIFEST, STATE):
        try:
            return int(json.loads((p / name).read_text())["step"]), p.stat().st_mtime
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return -1, p.stat().st_mtime


def checkpoints(root: Path) -> list[Path]:
    """Every checkpoint directory below `root` (or `root` itself), newest first."""
    if _is_checkpoint(root):
        return [root]
    if not root.is_dir():
        return []
    found = {p.parent for name in (MANIFEST, STATE) for p in root.rglob(name)}
    found |= {p for p in root.rglob("step_*") if p.is_dir() and _NAME.search(p.name)}
    return sorted(found, key=_order, reverse=True)


def select(path: str | Path, checksums: bool = True) -> Selection:
    """The checkpoint to continue from, given what a user gives `--resume`: a run directory (or any folder
    above checkpoints): its newest complete checkpoint; or one checkpoint: itself if complete, else the
    newest complete one before it in its folder. Raises FileNotFoundError where there is none at all, and
    CheckpointError (naming every damaged file) where none is complete."""
    p = Path(path).expanduser().resolve()
    if not p.exists():
        raise ResumeError(
            f"--resume {path}: no such file or directory; give a run's folder (run_dir/<run name>)"
        )
    if _is_checkpoint(p):
        mine = _order(p)
        siblings = [c for c in p.parent.iterdir() if c != p and _is_checkpoint(c) and _order(c) <= mine]
        candidates = [p, *sorted(siblings, key=_order, reverse=True)]
    else:
        candidates = checkpoints(p)
    if not candidates:
        if (p / "config.json").is_file():  # an HF model folder, e.g. a run's final/
            raise ResumeError(
                f"--resume {path}: a model folder, not a checkpoint (--resume continues a run: its optimizer, "
                f"data position and rollout queue); to start a new run from these weights give "
                f"model.path={path}"
            )
        raise ResumeError(
            f"--resume {path}: no checkpoint in it (no {MANIFEST} or {STATE} below it); give a run directory "
            "or one of its checkpoints (they are saved every train.save_every steps and when a run stops)"
        )
    skipped: list[tuple[Path, list[Damage]]] = []
    for c in candidates:
        damage = verify(c, checksums)
        if not damage:
            return Selection(c, _order(c)[0], legacy=not (c / MANIFEST).exists(), skipped=skipped)
        skipped.append((c, damage))
    detail = "\n".join(f"  {c}: {'; '.join(map(str, d))}" for c, d in skipped)
    raise CheckpointError(
        f"--resume {path}: no complete checkpoint to continue from; every one is damaged:\n{detail}\n"
        "restore the damaged files from a copy, or start a new run without --resume"
    )


def newest(root: Path, checksums: bool = True) -> Selection | None:
    """The newest complete checkpoint below `root`, or None where there is none (damaged ones skipped)."""
    if not checkpoints(root):
        return None
    try:
        return select(root, checksums)
    except CheckpointError as e:
        log.warning("%s", e)
        return None


# ------------------------------------------------------------------ loading


def _options(learner: Any) -> Any:
    """With LoRA the checkpoint holds the adapters and their optimizer state only: the frozen base is the model
    at `model.path`, which `--resume` checks is the same (app/trainer/resume_check.py)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    lora = getattr(learner, "lora", None) is not None
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def load(learner: Any, path: Path, rank: int) -> dict[str, Any]:
    """Load model, optimizer, scheduler and RNG states into this rank; returns state.json with its
    "pipeline" (pipeline.json) and "config" (config.json, None for a checkpoint written before it).
    Raises CheckpointError where pipeline.json is missing: the stream is never restarted silently."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not (path / PIPELINE).exists():
        raise CheckpointError(
            f"checkpoint {path} has no {PIPELINE} (the prompt stream's position and queue): restoring it "
            "would train the epoch's prompts again; resume from a complete checkpoint (give the run directory)"
        )
    opts = _options(learner)
    model_sd, optim_sd = get_state_dict(learner.model, learner.opt, options=opts)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=str(path / "model"))
    set_state_dict(
        learner.model, learner.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=opts
    )
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
    state["pipeline"] = json.loads((path / PIPELINE).read_text())
    state["config"] = json.loads((path / CONFIG).read_text()) if (path / CONFIG).exists() else None
    return state


def find(path: str | Path) -> Path:
    """The checkpoint `--resume path` continues from (`select`, damaged ones skipped with a warning)."""
    sel = select(path)
    sel.warn()
    return sel.path


def truncate_log(log_path: Path, step: int) -> int:
    """Drop accounting records of steps after `step` (trained by a worker whose work a restore discarded);
    returns how many were dropped."""
    if not log_path.exists():
        return 0
    lines = log_path.read_text().splitlines()
    keep = [x for x in lines if json.loads(x)["step"] <= step]
    log_path.write_text("".join(x + "\n" for x in keep))
    return len(lines) - len(keep)
