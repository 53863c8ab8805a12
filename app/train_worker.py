"""The entry point of every Ray Train worker: build the trainer's pieces, restore or start, run the loop.

    sync          batch t is generated with weights t, trained, then t+1 is pushed.
    one_step_off  batch t+1 is generated (with weights t) while batch t trains; the push of t+1 waits
                  for that generation to finish, so every trained token is exactly one version old.
    fully_async   groups stream in while the trainer trains; pushes every `algorithm.sync_every` steps.

The loop and its parts are in app/trainer/ (the mode differences in app/trainer/sources/).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from app.sync import TrainerSync
from app.train_loop import Learner
from app.trainer.accounting import TrainedLog
from app.trainer.comm import Actors
from app.trainer.loop import run
from app.trainer.monitor import Monitor
from app.trainer.parts import Trainer
from app.trainer.sources import SOURCES
from app.trainer.state import restore_or_start
from app.trainer.validation import Validator


def train_worker(config: dict[str, Any]) -> None:
    """Entry point of every Ray Train worker (see app/driver.py for what `config` holds)."""
    from omegaconf import OmegaConf

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    t = build(OmegaConf.create(config["cfg"]), config)
    try:
        run(t, restore_or_start(t, config.get("resume")))
    finally:  # rank 0's queued MLflow calls, written within a deadline (app/tracking.py)
        if t.tracker is not None:
            t.tracker.close()


def build(cfg: Any, config: dict[str, Any]) -> Trainer:
    """This worker's learner (its FSDP2 shard), weight sync, batch source and, on rank 0, the loggers."""
    from app.metrics import trainer_metrics
    from app.tracking import Tracker

    torch.manual_seed(cfg.train.seed)
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.train.use_gpu else torch.device("cpu")
    torch.set_num_threads(max(1, int(cfg.train.worker_cpus)))
    learner = Learner(cfg, config["model_path"], device)
    actors = lookup_actors(cfg.ray.name, cfg.train.timeout_s)
    lead = learner.rank == 0
    tracker = Tracker(config["tracking_uri"], config["run_id"]) if lead else None
    prom = trainer_metrics()
    run_dir = Path(config["run_dir"])
    return Trainer(
        cfg=cfg,
        rank=learner.rank,
        learner=learner,
        sync=TrainerSync(cfg, learner, actors.hub, device),
        source=SOURCES[cfg.algorithm.mode](cfg, actors),
        actors=actors,
        run_dir=run_dir,
        model_path=config["model_path"],
        monitor=Monitor(actors if lead else None, cfg.train.stall_timeout_s, run_dir),
        accounting=TrainedLog(run_dir),
        prom=prom,
        tracker=tracker,
        validator=Validator(actors, tracker, prom) if lead else None,
    )


def lookup_actors(prefix: str, timeout_s: float) -> Actors:
    """The actors of run `prefix` (created by app/driver.py), looked up by name."""
    from app.rollouter import rollouter_name
    from app.weights.actors import get_actor
    from app.weights.control import control_name
    from app.weights.hub import hub_name

    return Actors(
        hub=get_actor(hub_name(prefix)),
        control=get_actor(control_name(prefix)),
        rollouter=get_actor(rollouter_name(prefix)),
        timeout_s=timeout_s,
    )
