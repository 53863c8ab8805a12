"""A run's folder under `run_dir` and its tracking: opened at the start, continued by `--resume`, closed at the end.

A run folder holds one run's lineage: its config, its checkpoints (`ray_train/`, Ray Train's storage), its
logs (metrics.jsonl, trained_groups.jsonl, rollouts.jsonl), its final model, and `tracking.json` naming its
MLflow (and W&B) run. It is locked while its run lives (app/infra/run_lock.py).

`--resume` of a run folder of this `run_dir` (or of a checkpoint in one) continues that folder: the same MLflow
run (status RUNNING again, metrics going on at their steps), the same W&B run, Ray Train's storage (its
checkpoints kept by `train.keep_checkpoints` across both), metrics.jsonl appended, and the trained-group and
rollout logs cut back to the checkpoint's step first (a run that crashed after its last checkpoint trained
steps that the resume trains again). A resume gets a new folder and MLflow run instead, tagged
`relay.resumed_from` as every resume is, where `tracking.run_name` names another folder, where the
checkpoint is outside `run_dir`, or where a complete checkpoint newer than the resumed one is in the folder
(continuing beside it would mix two lineages in one storage).
"""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from app.config import flatten

log = logging.getLogger(__name__)

RAY_TRAIN = "ray_train"  # Ray Train's storage in a run folder: the run's checkpoints


@dataclass
class RunFolder:
    """One run's name, folder (locked while the run lives: app/infra/run_lock.py) and MLflow run."""

    name: str
    dir: Path
    uri: str
    tracker: Any
    lock: Any = None

    def close(self, status: str) -> None:
        """End the MLflow run (its queued calls flushed within a deadline), then free the run folder."""
        try:
            self.tracker.end(status)
        finally:
            if self.lock is not None:
                self.lock.release()


def open_run(cfg: DictConfig, resume: str | None) -> RunFolder:
    """The run folder under `run_dir` (durable: app/infra/storage.py) with its config, and its MLflow run;
    `resume` (the checkpoint `--resume` selected) continues its own folder where it can (see the module's
    docstring)."""
    from app.infra.run_lock import RunLock, new_run_name
    from app.infra.storage import resolve_run_dir
    from app.infra.tracking import METRICS_FILE

    root = resolve_run_dir(cfg.run_dir)
    continued = continued_folder(root, resume, cfg.tracking.run_name)
    name = continued.name if continued else cfg.tracking.run_name or new_run_name()  # unique in a second
    run_dir = root / name
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock.acquire(run_dir)  # a live run with this name: refused here, naming it
    try:
        if (run_dir / RAY_TRAIN).exists() and continued is None:
            # Ray Train would quietly continue the earlier run's checkpoints under this name
            raise FileExistsError(
                f"{run_dir} already holds a run named {name!r}: continue it with `--resume {run_dir}`, or "
                "give this run another tracking.run_name (or run_dir)"
            )
        if continued is not None and resume:
            cut_logs(run_dir, Path(resume))
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        tracker = start_tracking(cfg, root, run_dir, continued is not None)
    except BaseException:
        lock.release()
        raise
    tracker.artifact(str(run_dir / "config.yaml"))
    if resume:
        tracker.tags({"relay.resumed_from": resume})
        how = "continuing this run folder" if continued is not None else "in a new run folder"
        log.info("resuming from checkpoint %s, %s", resume, how)
    uri = tracker.uri
    watch = uri if uri.startswith("http") else f"mlflow ui --backend-store-uri {uri}"
    metrics = run_dir / METRICS_FILE
    log.info(
        "run %s: MLflow run %s%s (watch: %s); metrics also in %s",
        name,
        tracker.run_id,
        " (continued)" if tracker.reopened else "",
        watch,
        metrics,
    )
    tracker.start_system_metrics()
    return RunFolder(name=name, dir=run_dir, uri=uri, tracker=tracker, lock=lock)


def start_tracking(cfg: DictConfig, root: Path, run_dir: Path, continuing: bool) -> Any:
    """The run's Tracker with its sinks: the MLflow run of the folder's `tracking.json` reopened where
    `continuing` (in the same store and experiment), else a new one; the record (re)written."""
    from app.infra.tracking import METRICS_FILE, Tracker
    from app.infra.tracking_sinks import open_sinks
    from app.infra.tracking_store import (
        artifact_root,
        check_reachable,
        default_uri,
        read_record,
        write_record,
    )

    t = cfg.tracking
    uri = t.uri or default_uri(str(root))
    record = read_record(run_dir) if continuing else {}
    same_store = record.get("uri") == uri and record.get("experiment") == t.experiment
    reopen = str(record.get("mlflow_run_id") or "") if same_store else ""
    wandb_id = str(record.get("wandb_run_id") or secrets.token_hex(6))
    params = flatten(cfg)
    check_reachable(uri)  # before the W&B run opens: an unreachable server fails first, in seconds
    sinks = open_sinks([s for s in t.sinks if s != "mlflow"], run_dir, t.experiment, wandb_id, params)
    try:
        artifacts = artifact_root(t.artifact_uri, uri, root)  # not the working directory's mlruns
        tracker = Tracker.start(
            uri,
            t.experiment,
            run_dir.name,
            params,
            artifacts,
            run_dir / METRICS_FILE,
            sinks=sinks,
            reopen=reopen,
        )
    except BaseException:
        sinks.close()
        raise
    sinks.release()  # the W&B run is the trainer's while it trains
    if continuing and not tracker.reopened:
        log.warning(
            "%s: its MLflow run %s is not in %s (experiment %r): MLflow run %s continues the folder",
            run_dir,
            record.get("mlflow_run_id", "(none recorded)"),
            uri,
            t.experiment,
            tracker.run_id,
        )
    record = {
        "uri": uri,
        "experiment": t.experiment,
        "mlflow_run_id": tracker.run_id,
        "wandb_run_id": wandb_id,
    }
    write_record(run_dir, record)
    return tracker


def trainer_sinks(cfg: Any, run_dir: Path) -> Any:
    """The sinks trainer rank 0 feeds, for the run folder the driver opened (its `tracking.json`)."""
    from app.infra.tracking_sinks import open_sinks
    from app.infra.tracking_store import read_record

    wandb_id = str(read_record(run_dir).get("wandb_run_id") or "")
    names = [s for s in cfg.tracking.sinks if s != "mlflow"]
    return open_sinks(names, run_dir, cfg.tracking.experiment, wandb_id or secrets.token_hex(6))


def continued_folder(root: Path, resume: str | None, run_name: str) -> Path | None:
    """The run folder under `root` that a resume from checkpoint `resume` continues, or None for a new one:
    the checkpoint must be in a folder's Ray Train storage, `run_name` (if set) must name that folder, and
    no complete checkpoint newer than it may be there."""
    from app.trainer import checkpoint

    if not resume:
        return None
    ckpt = Path(resume).resolve()
    try:
        parts = ckpt.relative_to(root.resolve()).parts
    except ValueError:
        return None
    if len(parts) < 3 or parts[1] != RAY_TRAIN:
        return None
    folder = root / parts[0]
    if run_name and run_name != folder.name:
        return None
    found = [c.resolve() for c in checkpoint.checkpoints(folder / RAY_TRAIN)]  # newest first
    newer = found[: found.index(ckpt)] if ckpt in found else found
    complete = [c for c in newer if not checkpoint.verify(c, checksums=False)]
    if complete:
        log.warning(
            "--resume %s: %s holds a newer complete checkpoint (%s); continuing beside it would mix two "
            "lineages, so this run gets a new run folder (`--resume %s` continues the folder from its newest)",
            resume,
            folder,
            complete[0].name,
            folder,
        )
        return None
    return folder


def cut_logs(run_dir: Path, ckpt: Path) -> None:
    """The folder's trained-group and rollout logs cut back to checkpoint `ckpt`'s step (what a crashed run
    trained after it is trained again), and its old summary.json removed (the resumed run writes its own)."""
    from app.trainer import accounting, checkpoint, rollout_log

    step = int(json.loads((ckpt / checkpoint.STATE).read_text())["step"])
    for name in (accounting.NAME, accounting.FILTERED, rollout_log.NAME):
        if dropped := checkpoint.truncate_log(run_dir / name, step):
            log.warning("%s: %d records of steps after %d dropped (trained again now)", name, dropped, step)
    (run_dir / "summary.json").unlink(missing_ok=True)
