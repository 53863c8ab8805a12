"""app/infra/run_lock.py and the driver's run folder (no Ray): unique names, a live run's folder refused naming it,
a dead run's folder free again, the store lock's deadline."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.infra.run_lock import LOCK_FILE, RunInUseError, RunLock, file_lock, new_run_name

REPO = Path(__file__).resolve().parents[1]


def test_run_names_are_unique_within_one_second():
    names = {new_run_name() for _ in range(200)}
    assert len(names) == 200
    assert all(re.fullmatch(r"relay-\d{8}-\d{6}-[0-9a-f]{6}", n) for n in names)


def test_a_second_lock_is_refused_naming_the_holder_then_free_after_release(tmp_path):
    first = RunLock.acquire(tmp_path)
    with pytest.raises(RunInUseError) as err:
        RunLock.acquire(tmp_path)
    msg = str(err.value)
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in msg and "tracking.run_name" in msg
    first.release()
    first.release()  # idempotent
    RunLock.acquire(tmp_path).release()


_HOLD = """
import sys
from pathlib import Path
from app.infra.run_lock import RunLock
lock = RunLock.acquire(Path(sys.argv[1]))
print("locked", flush=True)
sys.stdin.read()  # holds until killed or stdin closes
"""


def test_a_live_process_holds_the_folder_and_its_death_frees_it(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(RunInUseError, match=f"pid {proc.pid} on host"):
            RunLock.acquire(tmp_path)
    finally:
        proc.kill()  # dies without releasing: its record stays in the file
        proc.wait(timeout=30)
    assert f'"pid": {proc.pid}' in (tmp_path / LOCK_FILE).read_text()
    RunLock.acquire(tmp_path).release()  # the kernel released its lock: the folder is free


def test_file_lock_waits_with_a_deadline(tmp_path):
    path = tmp_path / "mlflow.db.lock"
    with file_lock(path, 1.0):
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="stayed locked"), file_lock(path, 0.3):
            pass
        assert time.monotonic() - t0 < 2
    with file_lock(path, 0.3):  # free again
        pass


def test_driver_refuses_a_second_run_with_the_same_name_and_an_unreachable_uri(tmp_path):
    from app.config import load_config
    from app.driver import open_run
    from app.infra.tracking import TrackingError

    cfg = load_config(None, [f"run_dir={tmp_path}", "tracking.run_name=same"])
    rec = open_run(cfg, None)
    try:
        with pytest.raises(RunInUseError, match=f"run folder {tmp_path / 'same'} is in use"):
            open_run(cfg, None)
    finally:
        rec.close("FINISHED")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bad = load_config(
        None, [f"run_dir={tmp_path}", "tracking.run_name=same", f"tracking.uri=http://127.0.0.1:{port}"]
    )
    t0 = time.monotonic()
    with pytest.raises(TrackingError, match=f"tracking.uri=http://127.0.0.1:{port}"):
        open_run(bad, None)
    assert time.monotonic() - t0 < 5
    RunLock.acquire(tmp_path / "same").release()  # the refused start freed the folder
