"""The vLLM adapter's pause, at unit level: which engine call each rollout.partial / recompute_kv makes.

The engine is a stand-in that records calls (vLLM's AsyncLLM and its engine-core client are the boundary);
tests/integration/test_async.py runs the same pauses in real vLLM engines."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from app.vllm import engine as vla


class _Core:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    async def pause_scheduler_async(self, mode: str, clear_cache: bool) -> None:
        self.calls.append(("core", mode, clear_cache))


class _Engine:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, bool]] = []
        self.engine_core = _Core(self.calls)

    async def pause_generation(self, *, mode: str, clear_cache: bool) -> None:
        self.calls.append(("engine", mode, clear_cache))


@pytest.mark.parametrize(
    ("partial", "recompute_kv", "call"),
    [
        ("keep", True, ("core", "keep", True)),  # frozen requests are preempted: their KV recomputed
        ("keep", False, ("core", "keep", False)),  # frozen requests keep their KV cache
        ("resubmit", True, ("engine", "abort", True)),
        ("off", True, ("engine", "wait", True)),
    ],
)
def test_pause_maps_partial_and_recompute_kv(partial: str, recompute_kv: bool, call: Any) -> None:
    eng = _Engine()
    asyncio.run(vla.pause(eng, partial, recompute_kv))
    assert eng.calls == [call]
