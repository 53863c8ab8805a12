"""Checkpoint discovery, accounting truncation and the stall watchdog (no Ray, no vLLM)."""

from __future__ import annotations

import json
import time

import pytest

from app import checkpoint
from app.watchdog import Watchdog, summarize


def _ckpt(path, step):
    path.mkdir(parents=True)
    (path / checkpoint.STATE).write_text(json.dumps({"step": step, "version": step}))
    return path


def test_find_takes_a_checkpoint_or_the_newest_below_a_run(tmp_path):
    a = _ckpt(tmp_path / "run" / "ray_train" / "x" / "step_000002_1", 2)
    b = _ckpt(tmp_path / "run" / "ray_train" / "x" / "step_000010_2", 10)
    assert checkpoint.find(a) == a.resolve()
    assert checkpoint.find(tmp_path / "run") == b.resolve()
    with pytest.raises(FileNotFoundError, match="no such file"):
        checkpoint.find(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no checkpoint in it"):
        checkpoint.find(tmp_path / "empty")


def test_truncate_log_drops_steps_after_the_checkpoint(tmp_path):
    log = tmp_path / "trained_groups.jsonl"
    log.write_text("".join(json.dumps({"uid": f"p{i}", "step": i // 2 + 1}) + "\n" for i in range(10)))
    assert checkpoint.truncate_log(log, 3) == 4
    assert [json.loads(x)["uid"] for x in log.read_text().splitlines()] == [f"p{i}" for i in range(6)]
    assert checkpoint.truncate_log(tmp_path / "missing.jsonl", 3) == 0


def test_watchdog_fires_with_a_report(tmp_path):
    fired = []
    dog = Watchdog(
        0.3,
        lambda: {"rollouter": {"generating": 8, "queued": 0}, "last_push": {"version": 3}},
        tmp_path / "stall_report.json",
        on_stall=fired.append,
        poll_s=0.05,
    ).start()
    dog.phase("waiting for 8 finished groups for step 4")
    for step in range(1, 4):  # steps keep completing: no report
        time.sleep(0.15)
        dog.step_done(step)
    assert not fired
    deadline = time.monotonic() + 5
    while not fired and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fired, "the watchdog did not fire"
    rep = json.loads((tmp_path / "stall_report.json").read_text())
    assert rep["last_step"] == 3 and rep["trainer"]["phase"].startswith("waiting for 8 finished groups")
    assert rep["rollouter"]["generating"] == 8 and "train.stall_timeout_s=0.3" in rep["error"]
    assert "waiting for 8 finished groups" in summarize(rep)


def test_watchdog_report_failure_still_reports(tmp_path):
    def broken():
        raise TimeoutError("hub did not answer")

    dog = Watchdog(0.01, broken, tmp_path / "r.json", on_stall=lambda r: None)
    time.sleep(0.05)
    rep = dog.check()
    assert rep is not None and "hub did not answer" in rep["report_error"]


def test_newest_complete_checkpoint(tmp_path):
    run = tmp_path / "ray_train"
    a = _ckpt(run / "step_000002_1", 2)
    b = _ckpt(run / "step_000004_2", 4)
    assert checkpoint.newest(run) is None  # no rank files, no DCP metadata: not complete
    for c in (a, b):
        (c / "model").mkdir()
        (c / "model" / ".metadata").write_text("x")
        (c / "rank0.pt").write_text("x")
    assert checkpoint.newest(run) == (4, b)
    (b / checkpoint.STATE).write_text(json.dumps({"step": 4, "world": 2}))  # rank 1's part missing
    assert checkpoint.newest(run) == (2, a)
    assert checkpoint.newest(tmp_path / "nothing") is None
