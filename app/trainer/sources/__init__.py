"""Batch sources, one per `algorithm.mode`: `SOURCES[mode](cfg, actors)`."""

from __future__ import annotations

from app.trainer.sources.base import BatchSource, RolloutSource
from app.trainer.sources.fully_async import FullyAsyncSource
from app.trainer.sources.one_step_off import OneStepOffSource
from app.trainer.sources.sync import SyncSource

SOURCES: dict[str, type[RolloutSource]] = {
    "sync": SyncSource,
    "one_step_off": OneStepOffSource,
    "fully_async": FullyAsyncSource,
}

__all__ = ["SOURCES", "BatchSource", "RolloutSource"]
