"""app/infra/run_lock.py and the run folder (app/run_folder.py, no Ray): unique names, a live run's folder refused
naming it, a dead run's folder free again, the store lock's deadline; `--resume` continuing a run folder and its
MLflow run, or starting a new one where it must."""

from __future__ import annotations

import json
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
        assert time.monotonic() - t0 < 0.3 + 10  # gave up at its deadline (margin for a loaded machine)
    with file_lock(path, 0.3):  # free again
        pass


def test_driver_refuses_a_second_run_with_the_same_name_and_an_unreachable_uri(tmp_path):
    from app.config import load_config
    from app.infra.tracking_store import TrackingError
    from app.run_folder import open_run

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


# ------------------------------------------------------------------ --resume of a run folder


def _checkpoint(run_dir: Path, step: int) -> Path:
    """A complete checkpoint of `step` in the run folder's Ray Train storage: the trainer's files as stand-ins,
    its manifest real (app/trainer/checkpoint.py verifies it)."""
    from app.trainer import checkpoint

    path = run_dir / "ray_train" / run_dir.name / f"step_{step:06d}_{int(time.time() * 1000)}"
    (path / "model").mkdir(parents=True)
    (path / "model" / ".metadata").write_bytes(b"meta")
    (path / "rank0.pt").write_bytes(b"rank")
    (path / checkpoint.STATE).write_text(json.dumps({"step": step, "version": step, "world": 1}))
    (path / checkpoint.PIPELINE).write_text("{}")
    checkpoint.write_manifest(path, checkpoint.describe(path), step)
    time.sleep(0.002)  # the next one's name is later
    return path


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_resume_continues_the_run_folder_and_its_mlflow_run(tmp_path):
    """A run crashed after its checkpoint of step 2, having trained step 3. `--resume <its folder>` continues
    the folder and the MLflow run (RUNNING again, step 3 logged again at its step, metrics.jsonl appended),
    the trained-group log cut back to step 2, the folder locked while it runs; one MLflow run in all."""
    from mlflow.tracking import MlflowClient

    from app.config import load_config
    from app.infra.tracking import METRICS_FILE
    from app.run_folder import open_run
    from app.trainer import checkpoint

    first = open_run(load_config(None, [f"run_dir={tmp_path}"]), None)
    for step in (1, 2, 3):
        first.tracker.metrics({"loss": 1.0 / step}, step)
    _checkpoint(first.dir, 2)
    groups = first.dir / "trained_groups.jsonl"
    groups.write_text("".join(json.dumps({"step": s, "uid": f"p{s}"}) + "\n" for s in (1, 2, 3)))
    first.close("FAILED")

    selected = str(checkpoint.select(first.dir).path)  # what `prepare` hands over for `--resume <folder>`
    cfg = load_config(None, [f"run_dir={tmp_path}", f"train.resume={first.dir}"])
    again = open_run(cfg, selected)
    client = MlflowClient(again.uri)
    try:
        assert again.dir == first.dir and again.name == first.name
        assert again.tracker.run_id == first.tracker.run_id and again.tracker.reopened
        assert client.get_run(again.tracker.run_id).info.status == "RUNNING"
        with pytest.raises(RunInUseError):
            RunLock.acquire(first.dir)
        again.tracker.metrics({"loss": 0.3}, 3)
    finally:
        again.close("FINISHED")
    run = client.get_run(first.tracker.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["relay.resumed_from"] == selected
    assert json.loads(run.data.tags["relay.params_changed"]) == {"train.resume": str(first.dir)}
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3, 3]
    assert _steps(first.dir / METRICS_FILE) == [1, 2, 3, 3]
    assert _steps(groups) == [1, 2]  # step 3 is trained again
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_resume_gets_a_new_folder_for_another_run_name_or_beside_a_newer_checkpoint(tmp_path):
    from mlflow.tracking import MlflowClient

    from app.config import load_config
    from app.run_folder import open_run

    named = [f"run_dir={tmp_path}", "tracking.run_name=a"]
    a = open_run(load_config(None, named), None)
    old = _checkpoint(a.dir, 2)
    a.close("FINISHED")
    client = MlflowClient(a.uri)
    # tracking.run_name names another folder: a new folder and MLflow run, tagged with what it resumed
    b = open_run(load_config(None, [f"run_dir={tmp_path}", "tracking.run_name=b"]), str(old))
    b.close("FINISHED")
    assert b.dir == tmp_path / "b" and b.tracker.run_id != a.tracker.run_id and not b.tracker.reopened
    assert client.get_run(b.tracker.run_id).data.tags["relay.resumed_from"] == str(old)
    # step 2 of a folder that holds a complete step 4: not continued beside it
    newer = _checkpoint(a.dir, 4)
    c = open_run(load_config(None, [f"run_dir={tmp_path}"]), str(old))
    c.close("FINISHED")
    assert c.dir not in (a.dir, b.dir) and c.tracker.run_id != a.tracker.run_id
    with pytest.raises(FileExistsError, match="already holds a run named 'a'"):
        open_run(load_config(None, named), str(old))  # that folder by name: refused, as a new run there is
    with pytest.raises(FileExistsError, match=f"--resume {a.dir}"):
        open_run(load_config(None, named), None)
    # the newer one damaged (a file missing): skipped, as a restore skips it, and the folder continued
    (newer / "rank0.pt").unlink()
    d = open_run(load_config(None, [f"run_dir={tmp_path}"]), str(old))
    d.close("FINISHED")
    assert d.dir == a.dir and d.tracker.run_id == a.tracker.run_id


def test_a_continued_folder_keeps_its_wandb_run_and_tensorboard_folder(tmp_path, monkeypatch):
    """tracking.sinks through the run folder: the W&B run's id is kept in tracking.json, so the trainer and a
    resume open the same W&B run; TensorBoard's event files all go to `<run folder>/tensorboard`."""
    import importlib.machinery

    from app.config import load_config
    from app.infra.tracking_sinks import STEP_KEY, TENSORBOARD_DIR
    from app.infra.tracking_store import RUN_RECORD
    from app.run_folder import open_run, trainer_sinks
    from tests.test_tracking import _StandInWandb

    pytest.importorskip("tensorboard")
    w = _StandInWandb()
    w.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # found by the config's package check
    monkeypatch.setitem(sys.modules, "wandb", w)
    over = [f"run_dir={tmp_path}", "tracking.sinks=[mlflow,tensorboard,wandb]"]
    first = open_run(load_config(None, over), None)
    record = json.loads((first.dir / RUN_RECORD).read_text())
    assert record["mlflow_run_id"] == first.tracker.run_id and w.finished == 1  # let go for the trainer
    trainer = trainer_sinks(load_config(None, over), first.dir)
    trainer.log({"loss": 1.0}, 1)
    trainer.close()
    first.close("FAILED")
    ckpt = _checkpoint(first.dir, 1)
    again = open_run(load_config(None, over), str(ckpt))
    again.tracker.metrics({"loss": 0.5}, 2)
    again.close("FINISHED")
    assert {i["id"] for i in w.inits} == {record["wandb_run_id"]} and len(w.inits) == 4
    assert w.logged == [{"loss": 1.0, STEP_KEY: 1}, {"loss": 0.5, STEP_KEY: 2}]
    assert json.loads((first.dir / RUN_RECORD).read_text()) == record
    assert list((first.dir / TENSORBOARD_DIR).glob("events.out.tfevents.*"))
