"""Fully asynchronous training end to end: groups stream into a bounded queue, admission keeps staleness
within the bound, pushes land while generations are in flight (partial rollouts), off-policy correction,
validation beside training, and the run ends cleanly when the data is exhausted with every prompt trained
exactly once."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.integration.conftest import REPO, assert_quiet, train_cmd

ASYNC_METRICS = [
    "staleness/mean",
    "staleness/max",
    "staleness/len_decile_0",
    "async/trainer_idle_ratio",
    "async/rollout_idle_ratio",
    "async/queue_depth",
    "async/partial_ratio",
    "async/max_version_span",
    "async/over_bound",
    "async/off_regenerated",
    "sync/pause_s",
    "actor/is_weight_mean",
    "val/reward",
]


def _prompts(cache_dir: Path, path: Path, n: int) -> list[str]:
    from app.config import load_config
    from app.driver import resolve_inputs

    rows = resolve_inputs(load_config("quick", [f"model.cache_dir={cache_dir}"])).train_rows[:n]
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({"id": r.uid, "prompt": r.prompt, "answer": r.answer, "data_source": "arith"}))
            f.write("\n")
    return [r.uid for r in rows]


# validation as tests/integration/test_eval.py checks it (two samples a prompt, pass@1 and pass@2): that test
# takes this mode's run (the session fixture `async_keep_run`) instead of a training run of its own
EVAL_VALIDATION = ("eval.val_n=2", "algorithm.val_temperature=1.0", "eval.k=[1,2]")


def async_run(
    ray_cluster,
    cache_dir,
    tmp_path,
    partial: str,
    correction: str,
    eta: float,
    over_bound: str,
    *extra: str,
    env: dict[str, str] | None = None,
    quiet_allowed: tuple[str, ...] = (),
) -> dict:
    """A fully_async CLI run over 20 prompts (one epoch) on the cluster at `ray_cluster["address"]` (`env`:
    the CLI's environment, else this process's; `quiet_allowed`: for `assert_quiet`): its RESULT with `uids`
    (the prompts), `dir` (the run folder) and `seconds`."""
    t0 = time.monotonic()
    uids = _prompts(cache_dir, tmp_path / "train.jsonl", 20)
    name = f"async-{partial}"
    cmd = train_cmd(
        ray_cluster,
        cache_dir,
        tmp_path,
        name,
        "algorithm.mode=fully_async",
        f"algorithm.max_staleness={eta}",
        f"algorithm.correction={correction}",
        f"rollout.partial={partial}",
        f"algorithm.over_bound={over_bound}",
        "rollout.max_tokens=64",  # long generations (EOS ignored) so that pushes land mid-generation
        "rollout.ignore_eos=true",
        "rollout.max_model_len=160",
        "rollout.max_inflight=6",
        # keep and resubmit: few sequences decode at once, so the last groups generate for longer than a train
        # step and a push lands while they are in flight (CI once saw every group of the keep run, and this
        # machine every group of the resubmit run, finish between pushes when all decoded at once).
        # off: a group's samples queued in vLLM behind max_num_seqs must finish before the push too (the
        # replica drains), or the group would hold samples of two versions
        "rollout.max_num_seqs=2",
        # keep: the frozen generations keep their KV cache (PipelineRL's in-flight update); the default,
        # recomputing it, runs in test_multiturn's fully_async keep episodes
        *(["rollout.recompute_kv=false"] if partial == "keep" else []),
        # keep: the pushes are staged (received while generating, the pause only copies them in)
        *(["sync.staged_receive=true"] if partial == "keep" else []),
        "train.steps=100",  # the data (20 prompts, one epoch) ends the run first
        f"data.train={tmp_path / 'train.jsonl'}",
        "data.epochs=1",
        "data.val_size=8",  # validation beside every step (its prompts' count is not what is checked)
        "algorithm.val_every=1",
        *extra,
    )
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # no Ray/Serve/Train shutdown noise in a clean run's log
    assert_quiet(proc.stdout, proc.stderr, quiet_allowed)
    (line,) = re.findall(r"RESULT (\{.*\})", proc.stdout)
    res = json.loads(line)
    return {**res, "uids": uids, "dir": str(tmp_path / name), "seconds": time.monotonic() - t0}


@pytest.mark.parametrize(
    "partial,correction,eta,over_bound",
    [
        ("keep", "decoupled", 1.0, "train"),
        ("resubmit", "tis", 0.5, "train"),
        ("off", "none", 2.0, "regenerate"),
    ],
)
def test_fully_async_drains_the_data_once_within_the_bound(
    partial, correction, eta, over_bound, ray_cluster, cache_dir, tmp_path, request
):
    from mlflow.tracking import MlflowClient

    if partial == "keep":  # shared with test_eval.py (validation settings: EVAL_VALIDATION)
        res = request.getfixturevalue("async_keep_run")
    elif partial == "off":  # shared with test_two_nodes.py (run on a cluster of two nodes)
        res = request.getfixturevalue("async_off_two_nodes_run")
    else:
        # one trainer rank: these runs are about the rollout (keep, which test_eval shares, trains on two)
        res = async_run(
            ray_cluster, cache_dir, tmp_path, partial, correction, eta, over_bound, "train.workers=1"
        )
    uids, run_dir = res["uids"], Path(res["dir"])
    assert res["ok"] and "exhausted" in res["stopped"], res
    assert res["steps"] == 3  # 8 + 8 + 4 groups

    trained = [json.loads(x) for x in (run_dir / "trained_groups.jsonl").read_text().splitlines()]
    assert Counter(t["uid"] for t in trained) == Counter(uids)  # every prompt once: nothing lost or repeated
    client = MlflowClient(res["tracking_uri"])
    for key in ASYNC_METRICS:
        assert client.get_metric_history(res["run_id"], key), f"metric {key} missing"
    over = client.get_metric_history(res["run_id"], "async/over_bound")[-1].value
    beyond = [t for t in trained if t["trained_at"] - t["min_version"] > -(-eta // 1)]
    if over_bound == "train":
        assert len(beyond) == over  # every group past the bound was counted (and trained with correction)
    else:
        assert beyond == []  # stragglers were regenerated: no trained token is beyond the bound
    assert max(m.value for m in client.get_metric_history(res["run_id"], "staleness/max")) <= 3
    # pushes landed while groups were generating: their tokens span versions (keep: continued under the new
    # weights; resubmit: aborted and resubmitted as prompt + partial response)
    spans = [t["max_version"] - t["min_version"] for t in trained]
    # off: pushes wait for the generations in flight, and a sample a push overtook (still on its way to the
    # replica when the push closed its gate) is generated again: a group's tokens come from one version
    if partial == "off":
        assert max(spans) == 0, spans
        assert max(m.value for m in client.get_metric_history(res["run_id"], "sync/pause_s")) > 0
        return
    assert max(spans) >= 1, spans
    if partial == "keep":  # every push after the first was staged by the replica's vLLM worker
        staged = [m.value for m in client.get_metric_history(res["run_id"], "sync/replica/stage_s")]
        assert staged and min(staged) > 0, staged
    if partial == "resubmit":
        assert client.get_metric_history(res["run_id"], "async/resubmitted")[-1].value > 0
    assert max(m.value for m in client.get_metric_history(res["run_id"], "async/partial_ratio")) > 0
    val_versions = [m.value for m in client.get_metric_history(res["run_id"], "val/version")]
    assert val_versions[0] == 0 and len(val_versions) >= 2
