"""Faults during a fully asynchronous run: a rollout replica killed mid-run (by its actor id).

The run must finish, every prompt of the dataset must be trained exactly once, the push to the dead replica
must fail within its deadline and the group re-form without it, and the replica Serve starts in its place
must hold the current weights before it serves.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections import Counter

from tests.integration.conftest import REPO, hub_status, train_cmd, wait_for
from tests.integration.test_async import _prompts

NAME = "chaos"


def test_killed_replica_loses_nothing(ray_cluster, cache_dir, tmp_path):
    import ray
    from ray.util.state import list_actors

    uids = _prompts(cache_dir, tmp_path / "train.jsonl", 400)
    cmd = train_cmd(
        ray_cluster,
        cache_dir,
        tmp_path,
        NAME,
        "algorithm.mode=fully_async",
        "algorithm.correction=decoupled",
        "rollout.min_replicas=2",
        "rollout.max_replicas=2",
        "rollout.max_tokens=48",  # long generations (EOS ignored): the run lasts past the replacement's start
        "rollout.ignore_eos=true",
        "rollout.max_model_len=128",
        "rollout.max_inflight=8",
        "sync.timeout_s=20",
        "train.steps=1000",  # the data (400 prompts, one epoch) ends the run first
        f"data.train={tmp_path / 'train.jsonl'}",
        "data.epochs=1",
        "data.val_size=8",
        "algorithm.val_every=1000",
    )
    log = tmp_path / "stderr.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        st = wait_for(  # training under way with both replicas
            "version 2 with both replicas in the group",
            lambda: (x := hub_status(NAME))["version"] >= 2 and len(x["group"]) == 2 and x,
            proc,
            log,
        )
        victims = [
            a
            for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
            if a.class_name == f"ServeReplica:{NAME}-rollout:rollout"
        ]
        assert len(victims) == 2, victims
        victim = ray.get_actor(victims[0].name, namespace=victims[0].ray_namespace)
        killed_at_version = st["version"]
        killed_at = time.time()
        victim_id = victims[0].name.rsplit("#", 1)[-1]  # SERVE_REPLICA::<app>#<deployment>#<replica id>
        ray.kill(victim, no_restart=True)  # Serve notices and starts a replacement
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 0, log.read_text()[-4000:]
    (line,) = re.findall(r"RESULT (\{.*\})", out)
    res = json.loads(line)
    assert res["ok"] and "exhausted" in res["stopped"], res

    trained = [json.loads(x) for x in (tmp_path / NAME / "trained_groups.jsonl").read_text().splitlines()]
    assert Counter(t["uid"] for t in trained) == Counter(uids)  # nothing lost, nothing trained twice
    members = json.loads((tmp_path / NAME / "rollout_members.json").read_text())["members"]
    # the killed replica was found by the failed push and left out of the group (a survivor whose receive
    # failed in the same broken broadcast may be dropped too: it registers again and rejoins)
    assert members[victim_id]["dropped"] and not members[victim_id]["alive"], members[victim_id]
    replacements = [m for m in members.values() if m["registered_at"] > killed_at]  # (not the survivor)
    for m in replacements:  # a replacement serves only once it holds the version current at that moment
        if m["first_served"]:
            assert m["first_served"]["version"] == m["first_served"]["hub_version"] > killed_at_version
