"""`ray job submit` for real: a short training job on the CLI-started head, its RESULT line, its MLflow run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from tests.integration.conftest import REPO


def _ray(ray_cluster, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    ray_bin = str(Path(sys.executable).parent / "ray")
    return subprocess.run(
        [ray_bin, "job", *args, "--address", ray_cluster["dashboard"]],
        cwd=REPO,
        env=ray_cluster["env"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_ray_job_submit_trains_and_reports(ray_cluster, cache_dir, tmp_path):
    from mlflow.tracking import MlflowClient
    from ray.job_submission import JobStatus, JobSubmissionClient

    job_id = f"relay-test-{int(time.time())}"
    entry = [
        sys.executable,
        "-m",
        "app",
        "train",
        "--config",
        "quick",
        "train.steps=2",
        "ray.name=job",
        f"run_dir={tmp_path}",
        f"model.cache_dir={cache_dir}",
        "tracking.register_model=relay-job-test",
    ]
    sub = subprocess.run(
        [
            str(Path(sys.executable).parent / "ray"),
            "job",
            "submit",
            "--address",
            ray_cluster["dashboard"],
            "--submission-id",
            job_id,
            "--no-wait",
            "--",
            *entry,
        ],
        cwd=REPO,
        env=ray_cluster["env"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sub.returncode == 0, sub.stderr[-3000:]
    jobs = JobSubmissionClient(ray_cluster["dashboard"])
    deadline = time.monotonic() + 600
    status = jobs.get_job_status(job_id)
    while not status.is_terminal():
        assert time.monotonic() < deadline, f"job {job_id} still {status} after 600 s"
        time.sleep(3)
        status = jobs.get_job_status(job_id)
    logs = _ray(ray_cluster, "logs", job_id).stdout
    assert status == JobStatus.SUCCEEDED, f"job ended {status}: {logs[-3000:]}"
    assert "SUCCEEDED" in _ray(ray_cluster, "status", job_id).stdout.upper()
    # the driver's RESULT line; progress bars forwarded from the workers may share its physical line
    lines = re.findall(r"RESULT (\{.*\})", logs)
    assert len(lines) == 1, logs[-2000:]
    res = json.loads(lines[0])
    assert res["ok"] and res["steps"] == 2 and res["weight_version"] == 2
    run = MlflowClient(res["tracking_uri"]).get_run(res["run_id"])
    assert run.info.status == "FINISHED" and run.data.metrics["weight/version"] == 2
    (mv,) = MlflowClient(res["tracking_uri"]).search_model_versions("name='relay-job-test'")
    assert mv.run_id == res["run_id"]  # the final checkpoint, registered
