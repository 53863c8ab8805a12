"""The rollout pool grows and shrinks mid-run: a replica added while training joins the weight group at the
next version boundary and serves only the current version; a replica removed leaves the group cleanly; the
run goes on and stops cleanly (SIGTERM) without a hang.

Scaling is forced through Serve's public REST API (`rollout.scaling=external`), the same call an operator
or an external autoscaler makes; with `rollout.scaling=auto` Serve makes the same change on load.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import urllib.request

from tests.integration.conftest import REPO, hub_status, train_cmd, wait_for

NAME = "scale"


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


def test_rollout_scales_out_and_in_mid_run(ray_cluster, cache_dir, tmp_path):
    from mlflow.tracking import MlflowClient

    cmd = train_cmd(
        ray_cluster,
        cache_dir,
        tmp_path,
        NAME,
        "train.steps=500",  # ended by a clean stop once the scale-out and scale-in are seen
        "algorithm.val_every=1000",
        "rollout.scaling=external",
        "train.workers=1",  # one trainer rank: this test is not about the trainer (2-rank runs: async keep, resume, LoRA resume)
    )
    log = tmp_path / "stderr.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True
        )
    try:
        first = wait_for("version 1", lambda: (s := hub_status(NAME))["version"] >= 1 and s, proc, log)
        (original,) = first["members"]
        _scale(ray_cluster["dashboard"], 2)

        def two_serving() -> dict | None:
            s = hub_status(NAME)
            new = [r for r in s["members"] if r != original]
            if new and s["members"][new[0]]["first_served"] and s["members"][new[0]]["pushes"] >= 2:
                return s
            return None

        both = wait_for(
            "the new replica to be admitted, serve and receive two pushes", two_serving, proc, log
        )
        (added,) = [r for r in both["members"] if r != original]
        assert sorted(both["group"]) == sorted([original, added])
        v_both = both["version"]
        _scale(ray_cluster["dashboard"], 1)

        def one_left() -> dict | None:
            s = hub_status(NAME)
            gone = [r for r, m in s["members"].items() if m["leaving"]]
            if gone and len(s["group"]) == 1 and s["version"] >= v_both + 2:
                return s
            return None

        after = wait_for("a replica to leave and two more pushes to the one left", one_left, proc, log)
        proc.send_signal(signal.SIGTERM)  # a clean stop after the current step
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 0, log.read_text()[-4000:]
    (line,) = re.findall(r"RESULT (\{.*\})", out)
    res = json.loads(line)
    assert res["ok"] and res["stopped"] == "signal SIGTERM", res
    assert res["weight_version"] >= after["version"]

    members = json.loads((tmp_path / NAME / "rollout_members.json").read_text())["members"]
    new = members[added]
    # version-gated join: its first rollout request was served with the version current at that moment
    assert new["admitted_at"] is not None and new["join_s"] > 0
    assert new["first_served"]["version"] == new["first_served"]["hub_version"] >= 1
    (gone,) = [r for r, m in members.items() if m["leaving"]]
    assert members[gone]["dropped"] is None  # it left; nobody had to time out on it
    assert members[gone]["pushes"] >= 2

    client = MlflowClient(res["tracking_uri"])
    replicas = [m.value for m in client.get_metric_history(res["run_id"], "rollout/replicas")]
    assert 2.0 in replicas and replicas[0] == 1.0 and replicas[-1] == 1.0, replicas
    joins = client.get_metric_history(res["run_id"], "rollout/join_s")
    assert len(joins) == 1 and joins[0].value > 0
