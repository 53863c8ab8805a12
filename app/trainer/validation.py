"""Validation on the rollout replicas (trainer rank 0): run now, or beside training and logged when it lands."""

from __future__ import annotations

import logging
from typing import Any

from app.records import ValResult
from app.trainer.comm import Actors

log = logging.getLogger("app.train")


class Validator:
    """Runs the rollouter's `validate()` and logs its `ValResult` to the tracker and Prometheus."""

    def __init__(self, actors: Actors, tracker: Any, prom: Any) -> None:
        self.actors, self.tracker, self.prom = actors, tracker, prom
        self.validated = -1  # the last version validated with `run`
        self.pending: tuple[Any, int] | None = None  # (ref, version) of a validation running beside training

    def run(self, version: int, step: int) -> float:
        """Validate the replicas' current weights (`version`) now; returns the reward."""
        self.validated = version
        res = self.actors.get(self.actors.rollouter.validate.remote(), f"validation of version {version}")
        return self.log(res, version, step)

    def launch(self, version: int) -> None:
        """Start validating `version` beside training (fully_async); `poll`/`drain` log it."""
        if self.pending is None:
            self.pending = (self.actors.rollouter.validate.remote(), version)

    def poll(self, step: int) -> float | None:
        """Log the validation started by `launch` if it finished; its reward, else None."""
        import ray

        if self.pending is None or not ray.wait([self.pending[0]], timeout=0)[0]:
            return None
        return self.drain(step)

    def drain(self, step: int) -> float | None:
        """Wait for the validation started by `launch` (if any) and log it."""
        if self.pending is None:
            return None
        ref, version = self.pending
        self.pending = None
        return self.log(self.actors.get(ref, "validation"), version, step)

    def log(self, res: ValResult, version: int, step: int) -> float:
        self.tracker.metrics(
            {
                "val/reward": res.reward,
                "val/version": version,
                "val/version_max": res.version_max,
                "timing/val_s": res.seconds,
                **res.extra,  # e.g. multi-turn episodes' val/tool_call_rate, val/turns_mean
            },
            step,
        )
        self.tracker.table(res.table, f"samples/val_v{version:05d}.json")
        self.prom.set("relay_val_reward", res.reward)
        log.info("validation at version %d: reward %.3f over %d prompts", version, res.reward, res.n)
        return res.reward
