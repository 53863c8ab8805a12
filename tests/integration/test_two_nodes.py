"""Two Ray nodes on this machine, as a cluster from cluster.yaml has them: a head with the custom resource
`rollout_node` and a second node (`ray start --address`, its own IP 127.0.0.2) with `train_node`. The run
pins the vLLM replica to the first (`resources.rollout_custom`) and the trainer to the second
(`resources.train_custom`): every weight push crosses nodes, over the group the trainer's node hosts at its
own address. `fully_async`, one epoch: every prompt trained exactly once, the run folder (and MLflow store)
on a path both nodes share.

The run is test_async.py's `rollout.partial=off` run (the session fixture `async_off_two_nodes_run`: one CLI
run serves both tests). The cluster is its own, driven by a `python -m app train` subprocess (the pytest
process stays the shared cluster's driver). Every process it starts is stopped by process group, and any Ray
worker they leave behind by pid.
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.integration.conftest import REPO, stop_nodes

log = logging.getLogger(__name__)
TRAIN_NODE_IP = "127.0.0.2"  # a loopback address of its own: the push must go to the trainer node's address
# the run's placement: the replica on the head (rollout_node), the trainer on the second node (train_node)
PLACEMENT = ("resources.rollout_custom={rollout_node: 0.01}", "resources.train_custom={train_node: 0.01}")


def _ray_start(env: dict[str, str], *args: str) -> subprocess.Popen:
    """`ray start --block ARGS` in a process group of its own (SIGTERM to the group stops the node)."""
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "ray"), "start", "--block", "--disable-usage-stats", *args],
        env=env,
        cwd=REPO,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _start_cluster(env: dict[str, str]) -> tuple[list[subprocess.Popen], str]:
    """The head (rollout_node) and a second node (train_node, at TRAIN_NODE_IP); the head's address."""
    from app.weights.group import free_port

    port = free_port()
    nodes = [
        _ray_start(
            env,
            "--head",
            f"--port={port}",
            "--num-cpus=4",
            '--resources={"rollout_node": 1}',
            "--include-dashboard=false",
            f"--dashboard-agent-listen-port={free_port()}",  # the shared cluster holds the default ports
            f"--ray-client-server-port={free_port()}",
        )
    ]
    address = f"127.0.0.1:{port}"
    try:
        _wait_nodes(env, address, 1, nodes)
        nodes.append(
            _ray_start(
                env,
                f"--address={address}",
                f"--node-ip-address={TRAIN_NODE_IP}",
                "--num-cpus=4",
                '--resources={"train_node": 1}',
                f"--dashboard-agent-listen-port={free_port()}",
            )
        )
        _wait_nodes(env, address, 2, nodes)
    except BaseException:
        stop_nodes(nodes)
        raise
    return nodes, address


def _wait_nodes(env: dict[str, str], address: str, count: int, nodes: list[subprocess.Popen]) -> None:
    """Until the cluster at `address` has `count` live nodes (asked by a subprocess: this process stays the
    shared cluster's driver)."""
    probe = (
        f"import ray; ray.init(address={address!r}, log_to_driver=False); "
        "print(sum(n['Alive'] for n in ray.nodes()))"
    )
    deadline = time.monotonic() + 120
    while True:
        assert all(n.poll() is None for n in nodes), "a Ray node exited while starting"
        with contextlib.suppress(subprocess.TimeoutExpired):
            p = subprocess.run(
                [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60
            )
            if p.returncode == 0 and p.stdout.strip().splitlines()[-1:] == [str(count)]:
                return
        assert time.monotonic() < deadline, f"the cluster did not reach {count} node(s) in 120 s"
        time.sleep(2)


@contextmanager
def two_node_cluster(ray_cluster: dict) -> Iterator[tuple[str, dict[str, str], float]]:
    """The two nodes started (`_start_cluster`) and stopped at the end (`_stop`): the head's address, the
    environment a CLI run on them needs, and the seconds their start took."""
    t0 = time.monotonic()
    env = {k: v for k, v in ray_cluster["env"].items() if k != "RAY_ADDRESS"}
    env["RAY_AUTH_MODE"] = "disabled"  # a throwaway loopback cluster, as the shared one
    nodes, address = _start_cluster(env)
    try:
        yield address, env, time.monotonic() - t0
    finally:
        stop_nodes(nodes)


def test_fully_async_across_two_nodes_trains_each_prompt_once(async_off_two_nodes_run):
    res = async_off_two_nodes_run
    assert res["ok"] and "exhausted" in res["stopped"], res
    assert res["steps"] == 3 and res["weight_version"] == 3, res  # 8 + 8 + 4 groups

    run = Path(res["dir"])
    trained = [json.loads(x) for x in (run / "trained_groups.jsonl").read_text().splitlines()]
    assert Counter(t["uid"] for t in trained) == Counter(res["uids"])  # nothing lost, nothing trained twice
    st = json.loads((run / "rollout_members.json").read_text())
    (member,) = st["members"].values()
    # the trainer (rank 0 hosts the weight group) on the train node, the replica on the other node, and
    # pushes v0, v1, v2, v3 received there
    assert st["host"] == TRAIN_NODE_IP and member["node_ip"] not in ("", TRAIN_NODE_IP), st
    assert member["pushes"] == 4 and member["version"] == 3, member
    # the run folder (and MLflow store) under the run_dir both nodes reach (one machine: any local path)
    assert Path(res["final_checkpoint"], "config.json").exists() and res["tracking_uri"].endswith(
        f"{run.parent}/mlflow.db"
    ), res
    log.warning(
        "two nodes: cluster up in %.1fs; replica on %s, weight group at %s; %d pushes; %d groups trained "
        "once each; run %ss",
        res["cluster_s"],
        member["node_ip"],
        st["host"],
        member["pushes"],
        len(trained),
        res["wall_s"],
    )
