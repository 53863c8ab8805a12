"""bench/async_speedup.py's figures, with hand-computed values: the steady-state tokens/s (the first step's
warm-up excluded) and the ratios to `sync`."""

from __future__ import annotations

import math

from bench.async_speedup import ratios, steady_tokens_per_s, step_ratios


def test_steady_tokens_per_s_leaves_out_the_first_step():
    # step 1 ends at 20 s after a long warm-up; steps 2-4 (300 + 500 + 400 tokens) end at 24, 27 and 32 s
    pts = [(3, 27.0, 500.0), (1, 20.0, 9999.0), (4, 32.0, 400.0), (2, 24.0, 300.0)]  # in any order
    assert steady_tokens_per_s(pts) == 1200.0 / 12.0
    assert math.isnan(steady_tokens_per_s([(1, 20.0, 100.0)]))  # one step: no steady state
    assert math.isnan(steady_tokens_per_s([]))


def test_ratios_to_sync():
    res = {
        "sync": {"tokens_per_s": 100.0, "step_ms": 800.0, "steady_tokens_per_s": 120.0},
        "one_step_off": {"tokens_per_s": 95.0, "step_ms": 500.0, "steady_tokens_per_s": 192.0},
        "fully_async": {"tokens_per_s": 250.0, "step_ms": 400.0, "steady_tokens_per_s": float("nan")},
    }
    assert ratios(res, "tokens_per_s") == {"sync": 1.0, "one_step_off": 0.95, "fully_async": 2.5}
    assert ratios(res, "steady_tokens_per_s") == {"sync": 1.0, "one_step_off": 1.6}  # NaN left out
    assert step_ratios(res) == {"sync": 1.0, "one_step_off": 1.6, "fully_async": 2.0}  # lower is faster
    assert ratios({"one_step_off": {"tokens_per_s": 95.0}}, "tokens_per_s") == {}  # no sync run
