"""Multi-turn, tool-using rollouts end to end: the calculator task (`--config calc`) in fully_async mode with
partial rollouts kept. Episodes of several model turns interleaved with environment tokens, pushes landing
between and inside turns (trajectories whose tokens span versions), every prompt trained exactly once, and the
env/* metrics in MLflow."""

from __future__ import annotations

import json
import re
import subprocess
from collections import Counter

from tests.integration.conftest import REPO, train_cmd

ENV_METRICS = ["env/turns_mean", "env/tool_calls", "env/tool_call_rate", "env/step_s", "env/token_share"]


def test_calculator_episodes_fully_async_once_each(ray_cluster, cache_dir, tmp_path):
    from mlflow.tracking import MlflowClient

    from app.tasks.calc import ensure_builtin_calc, ensure_calc_task

    # builtin:tiny-calc, built here with a quarter of its warm-up (600 steps: ~4 minutes of this test's CPU on
    # a 2-core machine); it already calls the tool in ~20% of its sampled replies, which is all this test needs
    ensure_builtin_calc(cache_dir, warmup_steps=150)
    rows = (ensure_calc_task(cache_dir) / "train.jsonl").read_text().splitlines()[:40]
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    uids = [json.loads(r)["id"] for r in rows]
    name = "multiturn"
    cmd = train_cmd(
        ray_cluster,
        cache_dir,
        tmp_path,
        name,
        "algorithm.mode=fully_async",
        "algorithm.max_staleness=1",
        "rollout.partial=keep",
        "rollout.n=4",
        "train.steps=100",  # the data (40 prompts, one epoch) ends the run first
        f"data.train={tmp_path / 'train.jsonl'}",
        "data.epochs=1",
        "data.val_size=16",
        "algorithm.val_every=2",
        "train.workers=1",  # one trainer rank: this test is not about the trainer (2-rank runs: async keep, resume, LoRA resume)
        config="calc",
    )
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = re.findall(r"RESULT (\{.*\})", proc.stdout)
    res = json.loads(line)
    assert res["ok"] and "exhausted" in res["stopped"], res
    assert res["steps"] == 5  # 40 prompts in batches of 8 groups

    trained = [json.loads(x) for x in (tmp_path / name / "trained_groups.jsonl").read_text().splitlines()]
    assert Counter(t["uid"] for t in trained) == Counter(uids)  # every prompt once: nothing lost or repeated
    turns = [n for t in trained for n in t["turns"]]
    assert min(turns) >= 1 and max(turns) >= 2, turns  # episodes, some of them with a tool call and an answer
    spans = [s for t in trained for s in t["sample_spans"]]
    assert max(spans) >= 1, spans  # pushes landed mid-episode: one trajectory holds tokens of two versions
    for t in trained:
        assert t["trained_at"] - t["min_version"] <= 2, t  # staleness counts the oldest model token

    client = MlflowClient(res["tracking_uri"])
    hist = {k: [m.value for m in client.get_metric_history(res["run_id"], k)] for k in ENV_METRICS}
    for key, values in hist.items():
        assert values, f"metric {key} missing"
    assert max(hist["env/turns_mean"]) > 1.0 and max(hist["env/tool_calls"]) > 0
    assert 0 < max(hist["env/token_share"]) < 1  # environment tokens are part of the trajectories
    assert client.get_metric_history(res["run_id"], "val/tool_call_rate")
    # the loss saw the model's tokens only: fewer than the trajectories' tokens (environment tokens masked)
    loss_tokens = sum(m.value for m in client.get_metric_history(res["run_id"], "train/tokens"))
    assert 0 < loss_tokens < res["trained_tokens"], (loss_tokens, res["trained_tokens"])
