"""app/infra/log_filters.py's filter of Ray's driver output (RAY_NOISE): each known shutdown line of a clean run
(copied from a `make train` log) is dropped by Ray's own log deduplicator, and the errors that look like them
still print. No cluster starts: Ray's deduplicator is the code that filters what the driver prints."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from app.infra.log_filters import RAY_NOISE, RAY_SKIP_ENV, quiet_ray_noise, ray_noise_regex

REPO = Path(__file__).resolve().parents[1]

# lines of a clean `--config quick` run's log (Ray 2.60, vLLM 0.32), as Ray hands them to the driver
NOISE = [
    "Task ServeController.listen_for_change failed. There are infinite retries remaining, so the task will be "
    "retried. Error: The actor is dead because it was killed by `ray.kill`.",
    "Task ServeController.graceful_shutdown failed. There are infinite retries remaining, so the task will be "
    "retried. Error: The actor is dead because it was killed by `ray.kill`.",
    "INFO 2026-11-26 11:40:31,604 controller 21626 -- Removing 1 replica from Deployment(name='rollout', "
    "app='relay-rollout').",
    "INFO 2026-11-26 11:40:38,785 controller 21626 -- Replica(id='zvhu5voq', deployment='rollout', "
    "app='relay-rollout') is stopped.",
    "WARNING: 16 PYTHON worker processes have been started on node: 9534e77b916c9ed48bb1dc397860ce5bd6693e43fca0"
    "7317004dc833 with address: 192.0.2.2, which is 8x the maximum expected startup concurrency (2). This could "
    "be a result of using a large number of actors, or due to tasks blocked in ray.get() calls (see "
    "https://github.com/ray-project/ray/issues/3644 for some discussion of workarounds).",
    "WARNING 2026-11-26 10:02:11,122 placement_group_cleaner.py:93 -- Failed to query Ray Train Controller actor "
    "state. State API may be temporarily unavailable. Continuing to monitor.",
    "(EngineCore pid=22546) WARNING 11-26 11:40:38 [multiproc_executor.py:491] [shutdown] Executor: workers still "
    "running after grace period; sending SIGTERM count=1",
    "(MainProcess pid=21911) WARNING 11-26 11:40:38 [utils.py:648] [shutdown] Process manager: force killing "
    "remaining processes count=1",
    "(MainProcess pid=21911) WARNING 11-26 11:40:38 [utils.py:653] [shutdown] Process manager: force killing "
    "remaining process EngineCore pid 22546",
    "(MainProcess pid=21911) WARNING 11-26 11:40:38 [system_utils.py:225] [shutdown] force killing sub process "
    "VLLM::Worker pid 22955",
    "[rank0]:[W1126 10:03:01.123456789 ProcessGroupNCCL.cpp:1538] Warning: WARNING: destroy_process_group() was "
    "not called before program exit, which can leak resources. For more info, please see "
    "https://pytorch.org/docs/stable/distributed.html#shutdown (function operator())",
]
# what must still print: real failures that share words with the noise
KEPT = [
    "Task ServeController.listen_for_change failed. There are infinite retries remaining, so the task will be "
    "retried. Error: The actor died unexpectedly before finishing this task.",
    "Task Rollouter.progress failed. There are infinite retries remaining, so the task will be retried. Error: "
    "The actor is dead because it was killed by `ray.kill`.",
    "WARNING 2026-11-26 10:02:11,122 placement_group_cleaner.py:120 -- Failed to clean up placement group: boom",
    "WARNING 2026-11-26 11:38:34,986 controller 21626 -- Deployment 'rollout' in application 'relay-rollout' has "
    "1 replicas that have taken more than 30s to initialize.",
    "ERROR 2026-11-26 11:38:34,986 controller 21626 -- Exception in Replica(id='zvhu5voq', deployment='rollout', "
    "app='relay-rollout'), the replica will be stopped.",
    "(EngineCore pid=22546) ERROR 11-26 11:40:38 [core.py:1021] EngineCore encountered a fatal error.",
    "A worker died or was killed while executing a task by an unexpected system error.",
    "step 4: reward 0.406 loss -0.0000 gen 0.52s train 0.22s sync 0.290s staleness 0.00",
]


@pytest.mark.parametrize("line", NOISE)
def test_each_known_shutdown_line_is_matched(line):
    assert re.search(ray_noise_regex(), line), line


@pytest.mark.parametrize("line", KEPT)
def test_real_errors_are_not_matched(line):
    assert not re.search(ray_noise_regex(), line), line


def test_every_pattern_has_a_sample():
    for name, pattern in RAY_NOISE.items():
        assert any(re.search(pattern, ln) for ln in NOISE), f"{name}: no sample line"


def test_a_users_own_regex_is_kept(monkeypatch):
    monkeypatch.setenv(RAY_SKIP_ENV, "my noise")
    quiet_ray_noise()
    quiet_ray_noise()  # idempotent
    value = os.environ[RAY_SKIP_ENV]
    assert value == f"my noise|{ray_noise_regex()}"
    assert re.search(value, "here is my noise") and re.search(value, NOISE[0])
    monkeypatch.setenv(RAY_SKIP_ENV, "(unclosed")
    with pytest.raises(ValueError, match=f"{RAY_SKIP_ENV}='\\(unclosed' is not a regular expression"):
        quiet_ray_noise()


_DRIVER = """
import json, sys
from app.infra.log_filters import quiet_ray_noise
took = quiet_ray_noise()  # as app/__main__.py, before Ray is imported
from ray._private import ray_logging
lines = json.loads(sys.stdin.read())
out = ray_logging.stdout_deduplicator.deduplicate({"lines": lines, "pid": "raylet", "ip": "x", "is_err": False})
print(json.dumps({"took": took, "printed": [ln for b in out for ln in b["lines"]]}))
"""


def test_rays_driver_drops_the_noise_and_prints_the_rest():
    """Ray reads the filter when it is imported: in a fresh process, as the CLI's driver, Ray's deduplicator
    (what prints the workers' and the raylet's lines) drops every NOISE line and passes every KEPT one."""
    env = {k: v for k, v in os.environ.items() if k not in (RAY_SKIP_ENV, "RAY_DEDUP_LOGS")}
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER],
        input=json.dumps(NOISE + KEPT),
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["took"] is True
    assert got["printed"] == KEPT
