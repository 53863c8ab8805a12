"""`ray job submit` for real, against a head started as Ray 2.60 ships it (token authentication on): a
training job (the synchronous mode) stopped with `ray job stop` (SIGTERM: the clean stop), its RESULT line,
and its MLflow run (metrics, artifacts, a registered model) and checkpoints still readable after the cluster
stopped.

The head is this test's own (the session's shared cluster runs without authentication). Its HOME is a
temporary folder, so the token (`~/.ray/auth_token`, which turns authentication on for `ray start --head`)
and the job's default `run_dir` (`~/relay-runs`) land there and nowhere else.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from tests.integration.conftest import REPO, stop_nodes
from tests.integration.test_loop import check_tracked_run


def _start_head(env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """`ray start --head` with Ray's default authentication (RAY_AUTH_MODE unset); its dashboard address."""
    from app.weights.group import free_port

    port, dash, agent, client = free_port(), free_port(), free_port(), free_port()
    head = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "ray"),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            f"--dashboard-port={dash}",
            f"--dashboard-agent-listen-port={agent}",  # the shared cluster holds the default ports
            f"--ray-client-server-port={client}",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            "--num-cpus=16",
            "--disable-usage-stats",
        ],
        env=env,
        cwd=REPO,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return head, f"http://127.0.0.1:{dash}"


def _ray(
    env: dict[str, str], address: str, sub: str, *args: str, timeout: float = 120
) -> subprocess.CompletedProcess:
    """`ray job <sub> --address <address> <args>` (an entrypoint after `--` in `args` stays last)."""
    ray_bin = str(Path(sys.executable).parent / "ray")
    return subprocess.run(
        [ray_bin, "job", sub, "--address", address, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _job_state(client_env: dict[str, str], address: str, job_id: str) -> str:
    """SUCCEEDED, STOPPED, FAILED, or the state `ray job status` prints for a job not finished."""
    st = _ray(client_env, address, "status", job_id)
    out = st.stdout + st.stderr
    for state, says in (("SUCCEEDED", "' succeeded"), ("STOPPED", "' was stopped"), ("FAILED", "' failed")):
        if says in out:
            return state
    m = re.search(r"Status for job '[^']*': (?:JobStatus\.)?(\w+)", out)
    return m[1] if m else "UNKNOWN"


def _wait_job(client_env: dict[str, str], address: str, job_id: str, timeout: float = 600) -> str:
    deadline = time.monotonic() + timeout
    while (state := _job_state(client_env, address, job_id)) not in ("SUCCEEDED", "FAILED", "STOPPED"):
        assert time.monotonic() < deadline, f"job {job_id} not finished after {timeout} s: {state}"
        time.sleep(3)
    return state


def _wait_trained(client_env: dict[str, str], address: str, job_id: str, trained: Path) -> None:
    """Until three steps are trained (8 groups each: the weights moved), failing after 600 s or as soon as a
    job state check finds the job ended. The file is read every 2 s; the job's state (a `ray job status`
    process: about 2 s of CPU that the job's own run, on the same 2 cores, goes without) every 20 s."""
    deadline = time.monotonic() + 600
    next_state_check = 0.0
    while not (trained.exists() and len(trained.read_text().splitlines()) >= 24):
        ended = False
        if time.monotonic() >= next_state_check:
            ended = _job_state(client_env, address, job_id) in ("SUCCEEDED", "FAILED", "STOPPED")
            next_state_check = time.monotonic() + 20
        assert time.monotonic() < deadline and not ended, _ray(client_env, address, "logs", job_id).stdout[
            -3000:
        ]
        time.sleep(2)


def test_ray_job_submit_with_token_auth_stops_cleanly_and_keeps_results(ray_cluster, cache_dir, tmp_path):
    from mlflow.tracking import MlflowClient

    home = tmp_path / "home"
    home.mkdir()
    head_env = {k: v for k, v in ray_cluster["env"].items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    head_env["HOME"] = str(home)
    client_env = {**head_env, "RAY_AUTH_MODE": "token"}  # the README's step: the token from ~/.ray/auth_token
    # the token a first local run (`make train`: ray.init() makes one by default) leaves in ~/.ray/auth_token;
    # `ray start --head` then turns token authentication on
    gen = subprocess.run(
        [str(Path(sys.executable).parent / "ray"), "get-auth-token", "--generate"],
        env=head_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert gen.returncode == 0 and (home / ".ray" / "auth_token").exists(), gen.stderr
    head, address = _start_head(head_env)
    job_id = f"relay-test-{int(time.time())}"
    try:
        deadline = time.monotonic() + 90
        while (sub := _ray(client_env, address, "list")).returncode != 0:
            assert head.poll() is None and time.monotonic() < deadline, (
                f"head did not start: {sub.stderr[-2000:]}"
            )
            time.sleep(2)
        unauth = _ray({**head_env, "RAY_AUTH_MODE": "disabled"}, address, "list")
        assert unauth.returncode != 0 and "uthentication" in unauth.stdout + unauth.stderr, unauth
        # more steps than the test could ever wait out (a quick step is well under a second): `ray job stop`
        # ends the run, never its last step (a race the test once lost on a loaded machine at 100)
        steps = "train.steps=100000"
        entry = [sys.executable, "-m", "app", "train", "--config", "quick", steps, "ray.name=job"]
        entry += [f"model.cache_dir={cache_dir}", "tracking.register_model=relay-job-test"]  # default run_dir
        entry += ["tracking.run_name=jobrun", "algorithm.val_every=2"]
        entry += ["train.workers=1"]  # one trainer rank: the test is about the job, its stop and its results
        # `ray job stop` sends SIGTERM, then SIGKILL after RAY_JOB_STOP_WAIT_TIME_S (3 s unless set in the job's
        # runtime env): the clean stop needs the step in progress, a final checkpoint and the MLflow run
        stop_wait = '{"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "300"}}'
        sub = _ray(
            client_env,
            address,
            "submit",
            "--submission-id",
            job_id,
            "--runtime-env-json",
            stop_wait,
            "--no-wait",
            "--",
            *entry,
        )
        assert sub.returncode == 0, sub.stderr[-3000:]
        _wait_trained(client_env, address, job_id, home / "relay-runs" / "jobrun" / "trained_groups.jsonl")
        stop = _ray(client_env, address, "stop", job_id, timeout=400)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        state = _wait_job(client_env, address, job_id)
        logs = _ray(client_env, address, "logs", job_id).stdout
        assert state == "STOPPED", f"job ended {state}: {logs[-3000:]}"
    finally:
        stop_nodes([head])
    # the driver's RESULT line; progress bars forwarded from the workers may share its physical line
    lines = re.findall(r"RESULT (\{.*\})", logs)
    assert len(lines) == 1, logs[-2000:]
    res = json.loads(lines[0])
    assert res["ok"] and "SIGTERM" in res["stopped"], res  # the clean stop: RESULT as usual
    assert 3 <= res["steps"] < 100000 and res["weight_version"] >= 3, res
    # results under the default run_dir, ~/relay-runs, still there with the cluster gone
    runs = home / "relay-runs"
    assert res["tracking_uri"] == f"sqlite:///{runs / 'mlflow.db'}", res
    assert Path(res["checkpoint"]).is_relative_to(runs) and Path(res["checkpoint"]).exists(), res
    assert Path(res["final_checkpoint"], "config.json").exists(), res
    client = MlflowClient(res["tracking_uri"])
    run = client.get_run(res["run_id"])
    assert run.info.status == "FINISHED" and run.data.metrics["weight/version"] == res["steps"]
    (mv,) = client.search_model_versions("name='relay-job-test'")
    assert mv.run_id == res["run_id"]  # the final checkpoint, registered
    # the synchronous mode's run, as every mode's: metrics, artifacts, changed weights; on-policy, no KL
    check_tracked_run(res, next(Path(cache_dir).glob("builtin-v*/model")), "sync")
    assert max(m.value for m in client.get_metric_history(res["run_id"], "staleness/max")) == 0
    assert max(m.value for m in client.get_metric_history(res["run_id"], "loss/kl")) == 0
