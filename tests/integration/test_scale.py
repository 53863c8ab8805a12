"""The rollout pool grows and shrinks mid-run, then its last replica stalls: one CLI run, two tests.

A replica added while training joins the weight group at the next version boundary and serves only the
current version; a replica removed leaves the group cleanly; the run goes on. Then the one replica left is
stopped (SIGSTOP of its processes): no step completes, every wait is longer than the stall deadline, and the
watchdog fails the run with a report naming what each role was waiting for. (The clean SIGTERM stop that
once ended this run is test_job_submit's: `ray job stop` sends it.)

Scaling is forced through Serve's public REST API (`rollout.scaling=external`), the same call an operator
or an external autoscaler makes; with `rollout.scaling=auto` Serve makes the same change on load.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integration.conftest import REPO, hub_status, train_cmd, wait_for

NAME = "scale"
STALL_S = (
    45  # train.stall_timeout_s: generous, a loaded machine's normal step (scaling included) must not trip it
)


def _scale(dashboard: str, replicas: int) -> None:
    url = f"{dashboard}/api/v1/applications/{NAME}-rollout/deployments/rollout/scale"
    req = urllib.request.Request(
        url,
        data=json.dumps({"target_num_replicas": replicas}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200, resp.read()


def _scale_out_then_in(ray_cluster: dict, proc: subprocess.Popen, log: Path) -> dict:
    """Scale to 2 replicas, until the new one serves and took two pushes; back to 1, until one left and the
    other took two more pushes: the hub's status at each point."""
    first = wait_for("version 1", lambda: (s := hub_status(NAME))["version"] >= 1 and s, proc, log)
    (original,) = first["members"]
    _scale(ray_cluster["dashboard"], 2)

    def two_serving() -> dict | None:
        s = hub_status(NAME)
        new = [r for r in s["members"] if r != original]
        if new and s["members"][new[0]]["first_served"] and s["members"][new[0]]["pushes"] >= 2:
            return s
        return None

    both = wait_for("the new replica to be admitted, serve and receive two pushes", two_serving, proc, log)
    (added,) = [r for r in both["members"] if r != original]
    v_both = both["version"]
    _scale(ray_cluster["dashboard"], 1)

    def one_left() -> dict | None:
        s = hub_status(NAME)
        gone = [r for r, m in s["members"].items() if m["leaving"]]
        if gone and len(s["group"]) == 1 and s["version"] >= v_both + 2:
            return s
        return None

    after = wait_for("a replica to leave and two more pushes to the one left", one_left, proc, log)
    return {"original": original, "added": added, "both": both, "after": after}


def _stall_last_replica(ray_cluster: dict, proc: subprocess.Popen, log: Path, report: Path) -> float:
    """SIGSTOP the processes of the one replica left until the stall report appears (then SIGCONT, so that
    the replica is shut down normally): seconds from the stop to the report."""
    from ray import serve

    from app.names import app_name

    handle = serve.get_deployment_handle("rollout", app_name=app_name(NAME))
    info = handle.info.remote().result(timeout_s=30)
    ray_cluster["leftover_pids"].extend(info["child_pids"])
    stopped: list[int] = []
    try:
        t_stop = time.monotonic()
        for pid in [info["pid"], *info["child_pids"]]:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        wait_for("the stall report", report.exists, proc, log, timeout=180)
        return time.monotonic() - t_stop
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def scale_then_stall(ray_cluster, cache_dir, tmp_path_factory) -> dict:
    """The run: scaled out and in (`_scale_out_then_in`), then its last replica stalled; what was seen."""
    tmp_path = tmp_path_factory.mktemp("scale")
    cmd = train_cmd(
        ray_cluster,
        cache_dir,
        tmp_path,
        NAME,
        "train.steps=100000",  # ended by the watchdog once the scale-out and scale-in are seen, never by steps
        "algorithm.val_every=1000",
        "data.val_size=8",
        "rollout.scaling=external",
        "train.workers=1",  # one trainer rank: this test is not about the trainer (2-rank runs: async keep, resume, LoRA resume)
        f"train.stall_timeout_s={STALL_S}",
        "train.timeout_s=300",  # the watchdog, not a wait's own deadline, ends the stalled run
        "rollout.request_timeout_s=300",
    )
    log = tmp_path / "stderr.log"
    report = tmp_path / NAME / "stall_report.json"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True
        )
    try:
        seen = _scale_out_then_in(ray_cluster, proc, log)
        seen["detected_s"] = _stall_last_replica(ray_cluster, proc, log, report)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    (line,) = re.findall(r"RESULT (\{.*\})", out)
    return {
        **seen,
        "rc": proc.returncode,
        "res": json.loads(line),
        "dir": tmp_path,
        "log": log,
        "report": report,
    }


def test_rollout_scales_out_and_in_mid_run(scale_then_stall):
    from mlflow.tracking import MlflowClient

    run = scale_then_stall
    original, added, after = run["original"], run["added"], run["after"]
    assert sorted(run["both"]["group"]) == sorted([original, added])

    members = json.loads((run["dir"] / NAME / "rollout_members.json").read_text())["members"]
    new = members[added]
    # version-gated join: its first rollout request was served with the version current at that moment
    assert new["admitted_at"] is not None and new["join_s"] > 0
    assert new["first_served"]["version"] == new["first_served"]["hub_version"] >= 1
    (gone,) = [r for r, m in members.items() if m["leaving"]]
    assert members[gone]["dropped"] is None  # it left; nobody had to time out on it
    assert members[gone]["pushes"] >= 2

    # (the run was failed on purpose afterwards: its RESULT names no MLflow run; the run's name does)
    client = MlflowClient(f"sqlite:///{run['dir'] / 'mlflow.db'}")
    (mlflow_run,) = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], f"tags.mlflow.runName = '{NAME}'"
    )
    history = lambda key: [m.value for m in client.get_metric_history(mlflow_run.info.run_id, key)]  # noqa: E731
    assert max(history("weight/version")) >= after["version"]  # the run went on after the scale-in
    replicas = history("rollout/replicas")
    assert 2.0 in replicas and replicas[0] == 1.0 and replicas[-1] == 1.0, replicas
    joins = history("rollout/join_s")
    assert len(joins) == 1 and joins[0] > 0


def test_watchdog_reports_a_stalled_replica(scale_then_stall):
    """The one replica left after the scale-in is stopped (SIGSTOP) mid-run: the watchdog fails the run
    with a report naming what each role was waiting for."""
    run = scale_then_stall
    assert run["rc"] == 1, run["log"].read_text()[-3000:]
    res = run["res"]
    assert not res["ok"] and "no training step completed" in res["error"], res
    rep = json.loads(run["report"].read_text())
    # what the trainer waited for: a batch from the stopped replica, or its acknowledgement of a push
    phase = rep["trainer"]["phase"]
    assert phase.startswith(("waiting for", "pushing version")), rep
    if phase.startswith("waiting for"):
        assert rep["rollouter"]["generating"] > 0 and rep["rollouter"]["queued"] == 0, rep  # stuck requests
    assert isinstance(rep["rollouter"], dict) and rep["rollouter"]["replica_version"] >= 0, rep
    assert rep["replicas"] and rep["last_push"]["version"] >= 1, rep
    # the deadline runs from the last completed step, before the stop; the report's own queries take <= 20 s
    detected_s = run["detected_s"]
    assert detected_s < STALL_S + 30, detected_s
    print(f"\nwatchdog: stall detected {detected_s:.1f}s after the replica stopped (deadline {STALL_S}s)")
