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


class _Sampler:
    """An engine that records the SamplingParams of each request and answers one two-token completion."""

    def __init__(self) -> None:
        self.params: list[Any] = []

    def update_weight_version(self, v: int) -> None:  # labels tokens itself: no version book
        return None

    async def generate(self, prompt: dict, params: Any, request_id: str):
        self.params.append(params)
        comp = type("C", (), {"token_ids": [4, 5], "logprobs": None, "finish_reason": "stop", "index": 0})()
        yield type("O", (), {"outputs": [comp]})()


@pytest.mark.parametrize(("top_k", "stop"), [(0, None), (5, ["</a>", "\n\n"])])
def test_top_k_and_stop_strings_reach_sampling_params(top_k, stop) -> None:
    """`rollout.top_k` and `rollout.stop` become vLLM's; stop strings need detokenized output (vLLM refuses
    them otherwise), so only a request with stop strings is detokenized."""
    eng = _Sampler()
    kw = {
        "n": 2,
        "max_tokens": 3,
        "temperature": 1.0,
        "top_p": 0.9,
        "version": 0,
        "top_k": top_k,
        "stop": stop,
    }
    out = asyncio.run(vla.generate(eng, [1, 2], **kw))
    (p,) = eng.params
    assert p.top_k == top_k and p.top_p == 0.9 and p.detokenize == bool(stop)
    assert (p.stop or None) == stop
    assert out[0]["token_ids"] == [4, 5] and out[0]["finish_reason"] == "stop"
