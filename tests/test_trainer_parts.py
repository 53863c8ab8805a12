"""The trainer loop's pure parts: per-step metrics, the accounting log, the run state, mode policies."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from app.records import Batch, Group, Sample
from app.trainer.accounting import TrainedLog
from app.trainer.sources import SOURCES
from app.trainer.state import RunState
from app.trainer.step_metrics import StepTimings, step_metrics
from app.weights.records import PushStats


def _group(uid: str, versions: list[list[int]], rewards: list[float]) -> Group:
    samples = [
        Sample(token_ids=[7] * len(v), logprobs=[-1.0] * len(v), versions=v, finish_reason="stop", reward=r)
        for v, r in zip(versions, rewards, strict=True)
    ]
    return Group(uid=uid, prompt_ids=[1, 2], answer="a", samples=samples)


STATS = {"loss/policy": 0.5, "train/tokens": 6.0, "train/skipped_steps": 0.0}


def test_step_metrics_by_hand():
    # 2 samples of 3 and 1 tokens sampled by versions 4/5 and 3; trained into version 6 (so against 5)
    batch = Batch(
        groups=[_group("g", [[4, 5, 5], [3]], [1.0, 0.0])], generate_s=2.0, extra={"async/queue_depth": 3.0}
    )
    t = StepTimings(wait_s=1.0, overlap_wait_s=0.5, train_s=3.0, step_s=6.0)
    push = PushStats(version=6, nbytes=1000, total_s=0.25, ack_s=0.05, gather_s=0.1, transfer_s=0.1)
    push.extra = {"r0": {"held_s": 0.2, "join_s": 1.5}, "r1": {"held_s": 0.3}}  # generation held (acks)
    m = step_metrics(STATS, batch, t, push, version=6, pushed=6, step=3)
    assert m["loss/policy"] == 0.5 and m["async/queue_depth"] == 3.0  # stats and stream metrics pass through
    assert m["reward/mean"] == 0.5 and m["reward/std"] == 0.5
    assert m["staleness/mean"] == pytest.approx((1 + 0 + 0 + 2) / 4) and m["staleness/max"] == 2.0
    assert m["timing/wait_rollout_s"] == 1.5 and m["async/trainer_idle_ratio"] == pytest.approx(0.25)
    assert m["perf/gen_tokens_per_s"] == 2.0 and m["perf/train_tokens_per_s"] == 2.0  # 4 tok / 2 s, 6 / 3
    assert m["weight/version"] == 6 and m["weight/pushed_version"] == 6
    assert m["sync/time_s"] == pytest.approx(0.3) and m["sync/bytes"] == 1000.0
    assert m["sync/pause_s"] == 0.3 and m["rollout/replicas"] == 2.0 and m["rollout/join_s"] == 1.5
    # the first step: the replicas' joins are the initial ones, not a mid-run admission
    assert "rollout/join_s" not in step_metrics(STATS, batch, t, push, version=6, pushed=6, step=1)
    # no push this step (fully_async between pushes): no sync metrics
    m = step_metrics(STATS, batch, t, None, version=6, pushed=4, step=3)
    assert "sync/time_s" not in m and m["weight/pushed_version"] == 4
    # a replica admitted by a push made while the step waited for its batch (the loop's join push): its join
    # time is this step's, with or without a push after the step
    joined = PushStats(version=5, nbytes=1000)
    joined.extra = {"r2": {"held_s": 0.1, "join_s": 4.0}}
    assert step_metrics(STATS, batch, t, None, 6, 4, step=3, between=[joined])["rollout/join_s"] == 4.0
    assert step_metrics(STATS, batch, t, push, 6, 6, step=3, between=[joined])["rollout/join_s"] == 4.0


def test_trained_log_appends_and_truncates(tmp_path):
    log = TrainedLog(tmp_path)
    log.append(1, 0, [_group("a", [[0]], [1.0]), _group("b", [[0, 0]], [0.0])])
    log.append(2, 1, [_group("c", [[0, 1]], [1.0])])
    recs = log.records()
    assert [r["uid"] for r in recs] == ["a", "b", "c"]
    assert recs[2] == {
        "uid": "c",
        "step": 2,
        "trained_at": 1,
        "min_version": 0,
        "max_version": 1,
        "replica_min_version": {"": 0},  # per replica (these samples name none), its oldest token's version
        "sample_spans": [1],  # the one sample's tokens came from versions 0 and 1
        "turns": [0],  # a single-turn sample
    }
    assert log.truncate(1) == 1 and [r["uid"] for r in log.records()] == ["a", "b"]
    assert log.truncate(0) == 2 and log.records() == []
    assert TrainedLog(tmp_path / "none").truncate(3) == 0


def test_filtered_log_appends_and_truncates_with_the_trained_log(tmp_path):
    from app.records import Filtered

    log = TrainedLog(tmp_path)
    log.append_filtered(1, [Filtered(uid="a", epoch=0, reward=1.0), Filtered(uid="b", epoch=1, reward=0.0)])
    log.append_filtered(2, [])  # nothing dropped: no line
    log.append_filtered(3, [Filtered(uid="c", epoch=0, reward=0.5)])
    rows = [json.loads(x) for x in log.filtered_path.read_text().splitlines()]
    assert [(r["uid"], r["epoch"], r["step"], r["reward"]) for r in rows] == [
        ("a", 0, 1, 1.0),
        ("b", 1, 1, 0.0),
        ("c", 0, 3, 0.5),
    ]
    log.truncate(2)  # a restore to step 2 discards what step 3 dropped, too
    assert [json.loads(x)["uid"] for x in log.filtered_path.read_text().splitlines()] == ["a", "b"]


def test_run_state_round_trips_through_state_json():
    st = RunState(version=7, step=7, val_first=0.1, val_last=0.4, skipped_total=1, tokens_trained=900)
    st.stop, st.pushed = "signal", 5  # per-process fields are not saved
    d = json.loads(json.dumps(st.to_dict("fully_async", 2)))
    assert d["mode"] == "fully_async" and d["world"] == 2 and "stop" not in d
    back = RunState.from_dict({**d, "saved_at": 1.0, "pipeline": None})
    assert (back.version, back.step, back.val_first, back.val_last) == (7, 7, 0.1, 0.4)
    assert (back.skipped_total, back.tokens_trained, back.pushed, back.stop) == (1, 900, 7, None)
    assert RunState.from_dict({"version": 2, "step": 2}).skipped_total == 0  # an older state.json


def test_push_policy_per_mode():
    cfg = SimpleNamespace(
        train=SimpleNamespace(batch_groups=4, steps=6), algorithm=SimpleNamespace(sync_every=3, val_every=5)
    )
    actors = SimpleNamespace(rollouter=None, timeout_s=1.0)
    assert set(SOURCES) == {"sync", "one_step_off", "fully_async"}
    for mode in ("sync", "one_step_off"):
        src = SOURCES[mode](cfg, actors)
        assert all(src.should_push(s, False) for s in range(1, 7))
    # one_step_off starts the batch after the next one at the push only where the loop will ask for it: after
    # step s the loop trains s + 1 and, where s + 2 <= steps, asks for s + 2 (`more` of next_batch)
    src = SOURCES["one_step_off"](cfg, actors)
    wanted = []
    for s in range(1, 7):
        src.should_push(s, s == 6)
        wanted.append(src.follow_on)
    assert wanted == [True, True, True, True, False, False]
    src.should_push(2, True)  # a stop after step 2: nothing more
    assert src.follow_on is False
    src = SOURCES["fully_async"](cfg, actors)
    assert [s for s in range(1, 10) if src.should_push(s, False)] == [3, 6, 9]
    assert src.should_push(4, True)  # the last step always pushes


def test_each_mode_logs_only_the_metrics_that_mean_something_there():
    """A sync step logs no `async/*` metric and no staleness deciles (all zero there); one_step_off adds the
    trainer's idle share (generation overlaps training); fully_async adds the deciles and the partial-rollout
    metrics; dynamic sampling's count only with algorithm.filter_groups."""
    batch = Batch(
        groups=[_group("g", [[4, 5, 5], [3]], [1.0, 0.0])],
        extra={"async/filtered_groups": 0.0},
        generate_s=1.0,
    )
    t = StepTimings(wait_s=1.0, overlap_wait_s=0.5, train_s=3.0, step_s=6.0)
    logged = {}
    for mode, source in SOURCES.items():
        m = step_metrics(STATS, batch, t, None, 6, 6, step=3, families=source.metric_families)
        logged[mode] = {k for k in m if k.startswith(("async/", "staleness/"))}
    assert logged["sync"] == {"staleness/mean", "staleness/max"}
    assert logged["one_step_off"] == logged["sync"] | {"async/trainer_idle_ratio"}
    assert logged["fully_async"] == logged["one_step_off"] | {
        "staleness/len_decile_0",
        "staleness/len_decile_1",
        "async/partial_ratio",
        "async/max_version_span",
    }
    m = step_metrics(STATS, batch, t, None, 6, 6, step=3, families={"filtered"})
    assert m["async/filtered_groups"] == 0.0 and "async/trainer_idle_ratio" not in m
