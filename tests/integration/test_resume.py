"""Nothing lost: a trainer worker killed mid-run, a clean stop with partial rollouts in flight and a resume
from its checkpoint. (The watchdog on a stalled replica: tests/integration/test_scale.py, at the end of that
test's run.)

Every prompt group must be trained exactly once across the runs, no trained token may come from weights the
restore threw away, and the resumed partial rollouts keep the versions of the tokens generated before the
stop.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

from tests.integration.conftest import REPO, hub_status, train_cmd, wait_for
from tests.integration.test_async import _prompts


def _trained(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def _metric(res: dict, key: str) -> list[float]:
    from mlflow.tracking import MlflowClient

    return [m.value for m in MlflowClient(res["tracking_uri"]).get_metric_history(res["run_id"], key)]


def test_worker_kill_then_stop_and_resume_trains_each_prompt_once(ray_cluster, cache_dir, tmp_path):
    from ray.util.state import list_actors

    from app.names import hub_name

    # 17 steps of 8 groups. A reaches version 3, loses a worker, restores step 2 (or 4) and trains 2 more steps
    # before the stop: about 10 steps at most, since the staleness bound holds generation while the group
    # restarts. B then trains the rest (7 steps or more, so that C below has a checkpoint of B's to fall back
    # to): every prompt B trains is one more step of the suite's time. (Not
    # steps of 4 groups: generation then runs ahead to the staleness bound, 12 groups queued and none in
    # flight at the stop, and there is nothing to resume partially)
    uids = _prompts(cache_dir, tmp_path / "train.jsonl", 136)
    common = [
        "algorithm.mode=fully_async",
        "algorithm.max_staleness=2",
        "algorithm.correction=decoupled",
        "algorithm.over_bound=regenerate",
        "rollout.max_tokens=48",  # long generations (EOS ignored): groups are in flight at every push
        "rollout.ignore_eos=true",
        "rollout.max_model_len=128",
        "rollout.max_inflight=8",
        "rollout.max_num_seqs=4",  # generation is the bottleneck: groups are always in flight
        "train.steps=1000",  # the data (136 prompts, one epoch) ends the run
        "train.save_every=2",
        "train.max_failures=1",
        f"data.train={tmp_path / 'train.jsonl'}",
        "data.epochs=1",
        "data.val_size=8",
        "algorithm.val_every=1000",
    ]
    log_a = tmp_path / "a.log"
    with open(log_a, "w") as err:
        proc = subprocess.Popen(
            train_cmd(ray_cluster, cache_dir, tmp_path, "resume-a", *common),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        wait_for("version 3", lambda: hub_status("resume-a")["version"] >= 3, proc, log_a)
        # this run's trainer workers: those of the job (the run's driver) that created its weight hub (an
        # earlier test's workers may still be shutting down)
        # (the shared cluster's address: the job test's own head, stopped since, is the machine's latest)
        at = ray_cluster["address"]
        (hub,) = list_actors(at, filters=[("name", "=", hub_name("resume-a")), ("state", "=", "ALIVE")])
        workers = [
            a
            for a in list_actors(at, filters=[("state", "=", "ALIVE")], limit=1000, detail=True)
            if a.class_name == "RayTrainWorker" and a.job_id == hub.job_id
        ]
        assert len(workers) == 2, workers
        t_kill = time.monotonic()
        os.kill(workers[-1].pid, signal.SIGKILL)  # one trainer worker dies: Ray Train restarts the group
        # restored from the checkpoint of step 2 (or 4): training goes on past where it died
        st = wait_for(
            "training to go on after the restart",
            lambda: (
                (x := hub_status("resume-a"))["trainer"].get("restored_step") is not None
                and x["trainer"]["step"] >= x["trainer"]["restored_step"] + 2
                and x
            ),
            proc,
            log_a,
        )
        recovered_s = time.monotonic() - t_kill
        # Ctrl-C, as a terminal sends it (to the driver's pid): a clean stop, in-flight groups frozen into the
        # final checkpoint, RESULT printed, exit 0 (Ray Train's own SIGINT handler must not take over)
        proc.send_signal(signal.SIGINT)
        out_a, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 0, log_a.read_text()[-4000:]
    (line,) = re.findall(r"RESULT (\{.*\})", out_a)
    res_a = json.loads(line)
    assert res_a["ok"] and "SIGINT" in res_a["stopped"], res_a
    assert res_a["restored_from"] and res_a["restored_from"]["step"] >= 2, res_a
    assert _metric(res_a, "ckpt/restored_step"), "the restart did not restore the checkpoint"
    frozen = _metric(res_a, "ckpt/partial_groups")[-1]
    assert frozen > 0, "no generation was in flight at the stop (nothing to resume partially)"

    log_b = tmp_path / "b.log"
    proc_b = subprocess.run(
        [
            *train_cmd(ray_cluster, cache_dir, tmp_path, "resume-b", *common),
            "--resume",
            str(tmp_path / "resume-a"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log_b.write_text(proc_b.stderr)
    assert proc_b.returncode == 0, proc_b.stderr[-4000:]
    (line,) = re.findall(r"RESULT (\{.*\})", proc_b.stdout)
    res_b = json.loads(line)
    assert res_b["ok"] and "exhausted" in res_b["stopped"], res_b
    assert res_b["restored_from"]["step"] == res_a["steps"]
    assert _metric(res_b, "ckpt/restored_partial") == [frozen]
    # B names another run (tracking.run_name=resume-b): a new folder and MLflow run, not A's continued
    from mlflow.tracking import MlflowClient

    tags = MlflowClient(res_b["tracking_uri"]).get_run(res_b["run_id"]).data.tags
    assert res_b["run_id"] != res_a["run_id"] and "resume-a" in tags["relay.resumed_from"], tags

    a = _trained(tmp_path / "resume-a" / "trained_groups.jsonl")
    b = _trained(tmp_path / "resume-b" / "trained_groups.jsonl")
    assert Counter(t["uid"] for t in a + b) == Counter(uids)  # each prompt once across both runs
    for t in a + b:  # no token from weights a restore discarded; staleness within the bound
        assert t["min_version"] <= t["max_version"] <= t["trained_at"], t
        assert t["trained_at"] - t["min_version"] <= 2, t
    # resumed partial rollouts keep the versions of their tokens generated before the stop
    last_a = res_a["weight_version"]
    spanning = [t for t in b if t["min_version"] < last_a <= t["max_version"]]
    assert spanning, "no resumed group carries tokens from both runs"
    print(
        f"\nresume: worker killed at v{st['version']}, recovered (training again) in {recovered_s:.1f}s; "
        f"stop froze {frozen:.0f} partial groups; B resumed at v{last_a}, {len(spanning)} groups span both runs"
    )
    _refused_then_damaged_resume(ray_cluster, cache_dir, tmp_path, common, res_b, uids)


def _resume_cli(ray_cluster, cache_dir, tmp_path, name, common, *extra) -> tuple[int, dict, str, float]:
    """`python -m app train ... --resume <run B>`: (exit code, RESULT, stderr, seconds)."""
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            *train_cmd(ray_cluster, cache_dir, tmp_path, name, *common, *extra),
            "--resume",
            str(tmp_path / "resume-b"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    (tmp_path / f"{name}.log").write_text(proc.stderr)
    (line,) = re.findall(r"RESULT (\{.*\})", proc.stdout)
    return proc.returncode, json.loads(line), proc.stderr, time.monotonic() - t0


def _refused_then_damaged_resume(ray_cluster, cache_dir, tmp_path, common, res_b, uids) -> None:
    """Another model, or other data, refused before the run opens (no Ray); then B's newest checkpoint
    loses its pipeline.json: run C continues from B's previous checkpoint, saying so, and in the lineage
    A, B (up to that checkpoint), C every prompt is still trained exactly once."""
    other_model = tmp_path / "other-model"  # only its config.json is read: refused before anything loads it
    other_model.mkdir()
    (other_model / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64}))
    rc, res, err, secs = _resume_cli(
        ray_cluster,
        cache_dir,
        tmp_path,
        "resume-m",
        common,
        f"model.path={other_model}",
        "model.allow_toy_settings=true",  # a model that is not built in, on the toy task
    )
    # refused before anything starts: an input error (exit 2), like a config error
    assert rc == 2 and "'builtin:tiny'" in res["error"] and f"'{other_model}'" in res["error"], res
    assert "MLflow run" not in err, "refused only after the run opened"
    _prompts(cache_dir, tmp_path / "other.jsonl", 16)
    rc, res, err, secs_d = _resume_cli(
        ray_cluster, cache_dir, tmp_path, "resume-d", common, f"data.train={tmp_path / 'other.jsonl'}"
    )
    assert rc == 2 and "other.jsonl" in res["error"] and "--resume-with-new-data" in res["error"], res
    assert "MLflow run" not in err, "refused only after the run opened"

    damaged = Path(res_b["checkpoint"])
    (damaged / "pipeline.json").unlink()
    rc, res_c, err, secs_c = _resume_cli(ray_cluster, cache_dir, tmp_path, "resume-c", common)
    assert rc == 0 and res_c["ok"], err[-4000:]
    assert re.search(rf"checkpoint {re.escape(str(damaged))} is damaged \(pipeline.json: missing\)", err), (
        err[-4000:]
    )
    back = res_c["restored_from"]
    assert Path(back["path"]) != damaged and back["step"] <= res_b["steps"], back
    a = _trained(tmp_path / "resume-a" / "trained_groups.jsonl")
    b = [t for t in _trained(tmp_path / "resume-b" / "trained_groups.jsonl") if t["step"] <= back["step"]]
    # B's newest two may share a step (its last step was a save_every multiple): C then has nothing left
    c_log = tmp_path / "resume-c" / "trained_groups.jsonl"
    c = _trained(c_log) if c_log.exists() else []
    assert Counter(t["uid"] for t in a + b + c) == Counter(uids)  # once in the lineage A -> B -> C
    print(
        f"refused another model in {secs:.1f}s, other data in {secs_d:.1f}s (before Ray); C fell back to "
        f"step {back['step']} of B (newest: {res_b['steps']}) and trained {len(c)} groups in {secs_c:.0f}s"
    )
