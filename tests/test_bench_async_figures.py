"""bench/async_speedup.py's figures, with hand-computed values: the steady-state tokens/s (the first step's
warm-up excluded), the ratios to `sync`, and the modes of earlier runs joining them (`--with`)."""

from __future__ import annotations

import json
import math

import pytest

from bench.async_speedup import (
    check_comparable,
    last_json_line,
    merge_earlier,
    ratios,
    steady_tokens_per_s,
    step_ratios,
    with_ratios,
)


def test_steady_tokens_per_s_leaves_out_the_first_and_the_last_step():
    # step 1 ends at 20 s after a long warm-up; steps 2-4 (300 + 500 + 400 tokens) end at 24, 27 and 32 s;
    # step 5 (an overlapped mode's last: its training alone) ends 1 s later
    pts = [(3, 27.0, 500.0), (1, 20.0, 9999.0), (5, 33.0, 9999.0), (4, 32.0, 400.0), (2, 24.0, 300.0)]
    assert steady_tokens_per_s(pts) == 1200.0 / 12.0  # in any order
    first4 = [p for p in pts if p[0] <= 4]
    assert steady_tokens_per_s(first4) == 800.0 / 7.0  # steps 1-4 only: steps 2-3 over 20..27 s
    assert math.isnan(steady_tokens_per_s([(1, 20.0, 100.0), (2, 24.0, 100.0)]))  # two steps: no steady state
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


def test_earlier_runs_join_the_ratios_only_when_their_settings_match(tmp_path):
    head = {"prompts": 1024, "batch_groups": 128, "n": 8, "max_tokens": 1024, "lengths": "pareto:1.2:64"}
    head |= {"gpu": False, "gpus": 2, "shape": "1.5B", "overrides": ["rollout.max_num_seqs=512"]}
    sync = {"tokens_per_s": 11545.2, "steady_tokens_per_s": 12201.5, "step_ms": 17351.32}
    off = {"tokens_per_s": 14335.5, "steady_tokens_per_s": 16418.3, "step_ms": 11956.97}
    saved = tmp_path / "sync.out"
    saved.write_text("2026-11-27 INFO a log line\n" + json.dumps({**head, "modes": {"sync": sync}}) + "\n")
    earlier = [last_json_line(str(saved))]

    check_comparable(head, earlier)
    summary = {**head, "modes": merge_earlier({"one_step_off": off}, earlier)}
    got = with_ratios(summary)
    # 14335.5 / 11545.2 = 1.2417; 16418.3 / 12201.5 = 1.3456; 17351.32 / 11956.97 = 1.4511
    assert got["ratio_to_sync"] == {"sync": 1.0, "one_step_off": 1.242}
    assert got["steady_ratio_to_sync"] == {"sync": 1.0, "one_step_off": 1.346}
    assert got["step_ratio_to_sync"] == {"sync": 1.0, "one_step_off": 1.451}

    with pytest.raises(ValueError, match="batch_groups=128, this one 64"):
        check_comparable({**head, "batch_groups": 64}, earlier)
    (tmp_path / "empty.out").write_text("no json here\n")
    with pytest.raises(ValueError, match="no JSON line"):
        last_json_line(str(tmp_path / "empty.out"))


def test_per_step_lists_each_step_in_order_and_the_ends_after_the_first(tmp_path):
    from mlflow.tracking import MlflowClient

    from bench.async_speedup import per_step, run_series, steady_points

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    c = MlflowClient(uri)
    exp = c.create_experiment("e")
    run = c.create_run(exp).info.run_id
    # logged out of order, as nothing promises otherwise; step 1 ends at t=100 s, 2 at 110.5 s, 3 at 121 s
    for step, gen, train, at in ((2, 10.25, 5.0, 110.5), (1, 12.0, 20.0, 100.0), (3, 9.75, 5.5, 121.0)):
        ms = int(at * 1000)
        c.log_metric(run, "timing/generate_s", gen, timestamp=ms, step=step)
        c.log_metric(run, "timing/train_s", train, timestamp=ms, step=step)
        c.log_metric(run, "timing/step_s", max(gen, train), timestamp=ms, step=step)
        c.log_metric(run, "train/tokens", 1000.0, timestamp=ms, step=step)
    got = per_step(run_series(uri, run), steady_points(uri, run))
    assert got["generate_s"] == [12.0, 10.25, 9.75]
    assert got["train_s"] == [20.0, 5.0, 5.5]
    assert got["step_s"] == [20.0, 10.25, 9.75]
    assert got["wait_rollout_s"] == []  # not logged: an empty list, not an error
    assert got["end_s"] == [0.0, 10.5, 21.0]


def test_push_medians_read_the_same_series_per_step_lists(tmp_path):
    from mlflow.tracking import MlflowClient

    from bench.async_speedup import push_medians, run_series

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    c = MlflowClient(uri)
    run = c.create_run(c.create_experiment("e")).info.run_id
    for step, gen, push in ((2, 10.25, 0.02), (1, 12.0, 0.03), (3, 9.75, 0.0185)):
        c.log_metric(run, "timing/generate_s", gen, step=step)
        c.log_metric(run, "sync/time_s", push, step=step)
    got = push_medians(run_series(uri, run))
    assert got["generate_ms"] == 10250.0 and got["push_ms"] == 20.0
    assert math.isnan(got["train_ms"]) and math.isnan(got["pause_ms"])  # not logged: NaN, not an error
