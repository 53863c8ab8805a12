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

    # 14 steps of 8 groups. A reaches version 3, loses a worker, restores step 2 (or 4) and trains 2 more steps
    # before the stop: about 10 steps at most, since the staleness bound holds generation while the group
    # restarts. B then trains the rest (4 steps or more, so that C below has a checkpoint of B's to fall back
    # to): every prompt B trains is one more step of the suite's time. (Not
    # steps of 4 groups: generation then runs ahead to the staleness bound, 12 groups queued and none in
    # flight at the stop, and there is nothing to resume partially)
    uids = _prompts(cache_dir, tmp_path / "train.jsonl", 112)
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
        "train.steps=1000",  # the data (112 prompts, one epoch) ends the run
        "train.workers=2",  # two FSDP2 ranks: a sharded checkpoint, a rank's worker killed
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

    # B resumes A; while B starts, two resumes of A that must be refused before their run opens
    _prompts(cache_dir, tmp_path / "other.jsonl", 16)
    proc_b = _launch(ray_cluster, cache_dir, tmp_path, "resume-b", common, tmp_path / "resume-a")
    try:
        _refused_resumes(ray_cluster, cache_dir, tmp_path, common)
        rc, res_b, err_b, _ = _finish(proc_b, tmp_path, "resume-b")
    finally:
        if proc_b.poll() is None:
            proc_b.kill()
            proc_b.wait(timeout=30)
    assert rc == 0, err_b[-4000:]
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
    _damaged_resume(ray_cluster, cache_dir, tmp_path, common, res_b, uids)


def _launch(ray_cluster, cache_dir, tmp_path, name, common, resume: Path, *extra) -> subprocess.Popen:
    """Start `python -m app train ... --resume <resume>`, its stderr in `<name>.log`."""
    with open(tmp_path / f"{name}.log", "w") as err:
        return subprocess.Popen(
            [*train_cmd(ray_cluster, cache_dir, tmp_path, name, *common, *extra), "--resume", str(resume)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )


def _finish(proc: subprocess.Popen, tmp_path, name) -> tuple[int, dict, str, float]:
    """Wait for a `_launch`ed run: (exit code, RESULT, stderr, seconds waited)."""
    t0 = time.monotonic()
    out, _ = proc.communicate(timeout=900)
    err = (tmp_path / f"{name}.log").read_text()
    found = re.findall(r"RESULT (\{.*\})", out)
    assert len(found) == 1, f"{name}: exit code {proc.returncode}, no RESULT line: {err[-4000:]}"
    return proc.returncode, json.loads(found[0]), err, time.monotonic() - t0


def _refused_resumes(ray_cluster, cache_dir, tmp_path, common) -> None:
    """Resumes of A with another model, or with other data, both refused before the run opens (no Ray), as
    input errors (exit 2) naming the difference and the fix."""
    other_model = tmp_path / "other-model"  # only its config.json is read: refused before anything loads it
    other_model.mkdir()
    (other_model / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64}))
    t0 = time.monotonic()
    a = tmp_path / "resume-a"
    model = _launch(
        ray_cluster,
        cache_dir,
        tmp_path,
        "resume-m",
        common,
        a,
        f"model.path={other_model}",
        "model.allow_toy_settings=true",  # a model that is not built in, on the toy task
    )
    data = _launch(
        ray_cluster, cache_dir, tmp_path, "resume-d", common, a, f"data.train={tmp_path / 'other.jsonl'}"
    )
    (rc, res, err, _), (rc_d, res_d, err_d, _) = (
        _finish(p, tmp_path, n) for p, n in ((model, "resume-m"), (data, "resume-d"))
    )
    # refused before anything starts: an input error (exit 2), like a config error
    assert rc == 2 and "'builtin:tiny'" in res["error"] and f"'{other_model}'" in res["error"], res
    assert "MLflow run" not in err, "refused only after the run opened"
    assert rc_d == 2 and "other.jsonl" in res_d["error"] and "--resume-with-new-data" in res_d["error"], res_d
    assert "MLflow run" not in err_d, "refused only after the run opened"
    print(f"refused another model and other data in {time.monotonic() - t0:.1f}s (before Ray)")


def _damaged_resume(ray_cluster, cache_dir, tmp_path, common, res_b, uids) -> None:
    """B's newest checkpoint loses its pipeline.json: run C continues from B's previous checkpoint, saying
    so, and in the lineage A, B (up to that checkpoint), C every prompt is still trained exactly once."""
    damaged = Path(res_b["checkpoint"])
    (damaged / "pipeline.json").unlink()
    proc = _launch(ray_cluster, cache_dir, tmp_path, "resume-c", common, tmp_path / "resume-b")
    rc, res_c, err, secs_c = _finish(proc, tmp_path, "resume-c")
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
        f"C fell back to step {back['step']} of B (newest: {res_b['steps']}) and trained {len(c)} groups "
        f"in {secs_c:.0f}s"
    )
