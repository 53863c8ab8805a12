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


class _Cfg:
    def __init__(self, prefix_caching: bool) -> None:
        self.cache_config = type("C", (), {"enable_prefix_caching": prefix_caching})()


class _Outputs:
    def __init__(self, unfinished: bool) -> None:
        self.unfinished = unfinished

    def has_unfinished_requests(self) -> bool:
        return self.unfinished


class _Engine:
    def __init__(self, in_flight: bool = True, prefix_caching: bool = False) -> None:
        self.calls: list[tuple] = []
        self.engine_core = _Core(self.calls)
        self.vllm_config = _Cfg(prefix_caching)
        self.output_processor = _Outputs(in_flight)

    async def pause_generation(self, *, mode: str, clear_cache: bool) -> None:
        self.calls.append(("engine", mode, clear_cache))

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.calls.append(("reset", reset_running_requests))
        return True


_PREEMPT = ("reset", True)  # the frozen requests are preempted: their KV recomputed under the new weights


@pytest.mark.parametrize(
    ("partial", "recompute_kv", "in_flight", "calls"),
    [
        ("keep", True, True, [("core", "keep", False), _PREEMPT]),
        ("keep", True, False, [("core", "keep", False)]),  # nothing in flight: nothing to recompute
        ("keep", False, True, [("core", "keep", False)]),  # frozen requests keep their KV cache
        ("resubmit", True, True, [("core", "abort", False)]),
        ("off", True, True, [("core", "wait", False)]),
    ],
)
def test_pause_maps_partial_and_recompute_kv(
    partial: str, recompute_kv: bool, in_flight: bool, calls: Any
) -> None:
    """No pause clears the whole KV cache (vLLM walks every block of it: about 0.5 s on a large GPU)."""
    eng = _Engine(in_flight=in_flight)
    asyncio.run(vla.pause(eng, partial, recompute_kv))
    assert eng.calls == calls


def test_pause_clears_a_prefix_cache() -> None:
    """An engine with a prefix cache drops its hashes at every pause: they name blocks of the old weights."""
    eng = _Engine(in_flight=True, prefix_caching=True)
    asyncio.run(vla.pause(eng, "keep", True))
    assert eng.calls == [("core", "keep", True)]
