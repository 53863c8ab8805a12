"""Validation on the rollout replicas (trainer rank 0): run now, or beside training and logged when it lands.

Each validation answers the first `data.val_size` prompts of `data.val` (0: all) `eval.val_n` times; its
mean@n and pass@k per data source come from app/evaluation/scores.py, as in `python -m app eval`."""

from __future__ import annotations

import logging
from typing import Any

from app.evaluation.scores import ALL, MEAN, mean_key, metric_items
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
                **per_source(res.scores),
            },
            step,
        )
        self.tracker.table(res.table, f"samples/val_v{version:05d}.json")
        self.prom.set("relay_val_reward", res.reward)
        log.info(
            "validation at version %d: reward %.3f over %d prompts%s",
            version,
            res.reward,
            res.n,
            "".join(f"; {src}: {summary(v)}" for src, v in res.scores.items() if src != ALL)
            + "".join(f"; {k[4:]} {v:.3f}" for k, v in res.extra.items() if k.startswith("val/sub/")),
        )
        return res.reward


def per_source(scores: dict[str, dict[str, float]]) -> dict[str, float]:
    """mean@n and pass@k per data source as `val/<source>/mean_at_4`, `val/<source>/pass_at_1`, ...: where
    they say more than `val/reward` (several samples per prompt, or several sources)."""
    sources = [s for s in scores if s != ALL]
    several_samples = any(k != mean_key(1) and k.startswith(MEAN) for v in scores.values() for k in v)
    if not (several_samples or len(sources) > 1):
        return {}
    return metric_items(scores, "val")


def summary(values: dict[str, float]) -> str:
    """`mean_at_4 0.375, pass_at_1 0.375 (2 prompts)`."""
    named = ", ".join(f"{k} {v:.3f}" for k, v in values.items() if k != "prompts")
    return f"{named} ({values.get('prompts', 0):.0f} prompts)"
