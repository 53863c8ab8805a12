"""A fault during a fully asynchronous run, as a real cluster has it: one replica's vLLM engine dies (its
`VLLM::EngineCore` process SIGKILLed, as the kernel's OOM killer would) while its Serve actor lives on.

The run must finish and every prompt of the dataset must be trained exactly once. The replica with the dead
engine is dropped from the weight group (its own check, or the push that found it dead), fails its health
check so Serve replaces it; its requests (generation and validation) are retried on the live replica; a
replacement serves only once it holds the version current at that moment. (A replica whose actor dies is
the same path for requests and pushes; Ray Train worker death is tests/integration/test_resume.py's.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections import Counter

from tests.integration.conftest import REPO, hub_status, train_cmd, wait_for
from tests.integration.test_async import _prompts

NAME = "chaos"


def _engine_core_pid(replica_pid: int) -> int:
    """The vLLM engine-core process of one replica: a child of the replica actor's process."""
    import psutil

    for child in psutil.Process(replica_pid).children(recursive=True):
        try:
            if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()):
                return child.pid
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no EngineCore process under replica pid {replica_pid}")


def _replicas(address: str) -> list:
    """The run's live replica actors (asked of the shared cluster by address: another test's head, stopped
    since, may be the machine's latest cluster)."""
    from ray.util.state import list_actors

    return [
        a
        for a in list_actors(address, filters=[("state", "=", "ALIVE")], limit=1000, detail=True)
        if a.class_name == f"ServeReplica:{NAME}-rollout:rollout"
    ]


def test_dead_engine_loses_nothing(ray_cluster, cache_dir, tmp_path):

    uids = _prompts(cache_dir, tmp_path / "train.jsonl", 200)
    cmd = train_cmd(
        ray_cluster,
        cache_dir,
        tmp_path,
        NAME,
        "algorithm.mode=fully_async",
        "algorithm.correction=decoupled",
        "rollout.min_replicas=2",
        "rollout.max_replicas=2",
        "rollout.max_tokens=48",  # long generations (EOS ignored): the run lasts past the replacements' start
        "rollout.ignore_eos=true",
        "rollout.max_model_len=128",
        "rollout.max_inflight=8",
        "sync.timeout_s=20",
        "train.steps=1000",  # the data (200 prompts, one epoch) ends the run first
        f"data.train={tmp_path / 'train.jsonl'}",
        "data.epochs=1",
        "data.val_size=8",
        "algorithm.val_every=3",  # validation requests are in flight when the engine dies, too
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
        victims = _replicas(ray_cluster["address"])
        assert len(victims) == 2, victims
        ids = [v.name.rsplit("#", 1)[-1] for v in victims]  # SERVE_REPLICA::<app>#<deployment>#<replica id>
        core = _engine_core_pid(victims[0].pid)
        dead_engine_at_version, dead_engine_at = st["version"], time.time()
        t0 = time.monotonic()
        os.kill(core, signal.SIGKILL)  # the engine dies; the replica actor lives on
        wait_for(
            "the replica with the dead engine to leave the weight group",
            lambda: hub_status(NAME)["members"][ids[0]]["dropped"],
            proc,
            log,
            timeout=120,
        )
        left_s = time.monotonic() - t0
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
    assert members[ids[0]]["dropped"] and not members[ids[0]]["alive"], members[ids[0]]
    assert members[ids[1]]["alive"] or members[ids[1]]["dropped"], members[ids[1]]
    # a replacement serves only once it holds the version current at that moment
    for m in [m for m in members.values() if m["registered_at"] > dead_engine_at]:
        if m["first_served"]:
            assert (
                m["first_served"]["version"] == m["first_served"]["hub_version"] > dead_engine_at_version
            ), m
    print(
        f"\nchaos: engine killed at v{dead_engine_at_version}, its replica left the weight group after "
        f"{left_s:.1f}s ({members[ids[0]]['dropped']}); {len(trained)} groups trained once each; "
        f"{len(members) - 2} replacement(s) registered; run {res['wall_s']}s"
    )
