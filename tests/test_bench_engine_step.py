"""bench/engine_step_cost.py's figures, with hand-computed values: the points it parses and the cost each
further sequence adds to a decode step."""

from __future__ import annotations

import math

import pytest

from bench.engine_step_cost import parse_points, per_seq_ms


def test_parse_points():
    assert parse_points("512x256, 32x1024") == [(512, 256), (32, 1024)]
    for bad in ("512", "0x8", "ax8", "8x"):
        with pytest.raises(ValueError, match="use KxL"):
            parse_points(bad)


def test_per_seq_ms_fits_the_points_of_large_batches_only():
    # docs/benchmarks.md's H100 figures, 1.5B, ms a step: 512 -> 23.2, 256 -> 13.1, 128 -> 8.4; batch 8 at 3.1
    # lies off the line and is left out. Slope of the least-squares line through the three:
    # mean k = 298.67, mean ms = 14.9; sum (k-mk)(m-mm) = 213.33*8.3 + (-42.67)*(-1.8) + (-170.67)*(-6.5)
    # = 1770.67 + 76.8 + 1109.33 = 2956.8; sum (k-mk)^2 = 45511.1 + 1820.4 + 29127.1 = 76458.7 -> 0.03867
    pts = [(512, 23.2), (256, 13.1), (128, 8.4), (8, 3.1)]
    assert math.isclose(per_seq_ms(pts), 2956.8 / 76458.67, rel_tol=1e-4)
    assert per_seq_ms([(512, 23.2), (8, 3.1)]) is None  # one batch >= 32: no line
    assert per_seq_ms([(64, 5.0), (32, 4.0)]) == pytest.approx(1 / 32)


def test_pareto_lengths_draw_groups_of_one_length_within_bounds():
    from bench.engine_step_cost import pareto_lengths

    lens = pareto_lengths("128x8:1.2:64:1024")
    assert len(lens) == 1024 and min(lens) >= 64 and max(lens) <= 1024
    assert all(len(set(lens[g * 8 : g * 8 + 8])) == 1 for g in range(128))  # a group shares its length
    assert lens == pareto_lengths("128x8:1.2:64:1024")  # seeded: the same draw each run
    # min(MAX, int(MIN x U^(-1/ALPHA))) with U in (0, 1]: U = 1 gives MIN; a tiny U is capped at MAX
    assert pareto_lengths("1x2:1.0:5:5") == [5, 5]
    with pytest.raises(ValueError, match="GROUPSxN:ALPHA:MIN:MAX"):
        pareto_lengths("128x8:1.2")
