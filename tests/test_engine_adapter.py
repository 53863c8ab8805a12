"""The vLLM adapter's pause, at unit level: which engine call each rollout.partial / recompute_kv makes.

The engine is a stand-in that records calls (vLLM's AsyncLLM and its engine-core client are the boundary);
tests/integration/test_async.py runs the same pauses in real vLLM engines."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from app.rollout.partial import partial_policy
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
    asyncio.run(vla.pause(eng, partial_policy(partial), recompute_kv))
    assert eng.calls == calls


def test_pause_clears_a_prefix_cache() -> None:
    """An engine with a prefix cache drops its hashes at every pause: they name blocks of the old weights."""
    eng = _Engine(in_flight=True, prefix_caching=True)
    asyncio.run(vla.pause(eng, partial_policy("keep"), True))
    assert eng.calls == [("core", "keep", True)]


class _LoadingEngine(_Engine):
    """An engine core whose pause answers only once the step in flight ended (`step_done`), as vLLM's does
    under load, and whose workers' call (the weight load) ends that step's wait: each message is logged when
    it is sent, each answer when it comes."""

    def __init__(self, in_flight: bool = True, fail: bool = False) -> None:
        super().__init__(in_flight=in_flight)
        self.step_done = asyncio.Event()
        self.fail = fail
        log = self.calls

        class Core:
            async def pause_scheduler_async(core, mode: str, clear_cache: bool) -> None:
                log.append(("pause sent", mode))
                await self.step_done.wait()
                log.append(("pause answered", mode))

        self.engine_core = Core()

    async def collective_rpc(self, method: str, timeout: float | None = None, kwargs: Any = None) -> list:
        self.calls.append(("call sent", method))
        self.step_done.set()  # the step in flight ends while the workers receive
        await asyncio.sleep(0.01)
        if self.fail:
            raise RuntimeError("worker died")
        self.calls.append(("call answered", method))
        return [{"ok": True}]


def _paused_call(eng: _Engine, partial: str, recompute_kv: bool = True) -> tuple:
    async def run() -> tuple:
        call = vla.paused_call(eng, partial_policy(partial), recompute_kv, "relay_receive")
        return await asyncio.wait_for(call, 5)

    return asyncio.run(run())


@pytest.mark.parametrize(("partial", "mode"), [("keep", "keep"), ("resubmit", "abort")])
def test_paused_call_sends_the_load_behind_the_pause(partial: str, mode: str) -> None:
    """keep and resubmit stop every step at once: the load goes out right behind the pause, before its answer
    (which waits for the step in flight); the pause still finishes, its preemption included, before return."""
    eng = _LoadingEngine(in_flight=True)
    res, pause_s, call_s = _paused_call(eng, partial)
    assert res == [{"ok": True}]
    sent = [c for c in eng.calls if c[0] in ("pause sent", "call sent")]
    assert sent == [("pause sent", mode), ("call sent", "relay_receive")]
    assert eng.calls.index(("call sent", "relay_receive")) < eng.calls.index(("pause answered", mode))
    if partial == "keep":  # the frozen requests are preempted after the pause's answer, before return
        assert eng.calls.index(_PREEMPT) > eng.calls.index(("pause answered", mode))
    assert pause_s > 0 and call_s >= 0.01  # the call took its 10 ms


def test_paused_call_off_waits_for_the_pause() -> None:
    """off lets running requests step until they finish: the load goes only after the pause's answer."""
    eng = _LoadingEngine(in_flight=False)
    eng.step_done.set()  # nothing in flight: the pause answers at once
    _, pause_s, call_s = _paused_call(eng, "off")
    assert [c[0] for c in eng.calls] == ["pause sent", "pause answered", "call sent", "call answered"]
    assert pause_s <= call_s


def test_paused_call_finishes_the_pause_when_the_load_fails() -> None:
    """A failed load still leaves the pause finished before the error comes out (the caller then resumes)."""
    eng = _LoadingEngine(in_flight=True, fail=True)
    with pytest.raises(RuntimeError, match="worker died"):
        _paused_call(eng, "keep")
    assert ("pause answered", "keep") in eng.calls and eng.calls[-1] == _PREEMPT


class _BrokenPause(_Engine):
    """An engine core whose pause fails; the workers' call is logged if it is ever sent."""

    def __init__(self) -> None:
        super().__init__(in_flight=False)

        class Core:
            async def pause_scheduler_async(core, mode: str, clear_cache: bool) -> None:
                raise RuntimeError("engine core gone")

        self.engine_core = Core()

    async def collective_rpc(self, method: str, timeout: float | None = None, kwargs: Any = None) -> list:
        self.calls.append(("call sent", method))
        return [{"ok": True}]


def test_paused_call_names_a_pause_that_failed_before_any_load() -> None:
    """A failed pause before the call (off) is `PauseFailed`, nothing sent to the workers (the replica then keeps
    its version); where the call went out behind it (keep), the failure is the pause's own error."""
    eng = _BrokenPause()
    with pytest.raises(vla.PauseFailed, match="engine core gone"):
        _paused_call(eng, "off")
    assert eng.calls == []
    with pytest.raises(RuntimeError, match="engine core gone") as err:
        _paused_call(eng, "keep")
    assert not isinstance(err.value, vla.PauseFailed) and eng.calls == [("call sent", "relay_receive")]


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


class _Lp:
    def __init__(self, logprob: float) -> None:
        self.logprob = logprob


def test_sampled_logprobs_from_vllms_dict_a_position_or_none():
    # a dict a position: the sampled token's entry (the top-k may hold others)
    assert vla.sampled_logprobs([{5: _Lp(-0.5), 9: _Lp(-3.0)}, {7: _Lp(-1.25)}], [5, 7]) == [-0.5, -1.25]
    assert vla.sampled_logprobs(None, [1, 2]) == [0.0, 0.0]  # rollout.behaviour_logprobs=trainer
