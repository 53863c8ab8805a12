"""Checkpoints (manifest, verification, fallback, the config check of --resume), accounting truncation and the
stall watchdog (no Ray, no vLLM)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import torch

from app.errors import user_error
from app.infra.watchdog import Watchdog, summarize
from app.records import PipelineSnapshot, Prompt
from app.trainer import checkpoint, resume_check
from app.trainer.state import fresh_pipeline


def test_truncate_log_drops_steps_after_the_checkpoint(tmp_path):
    log = tmp_path / "trained_groups.jsonl"
    log.write_text("".join(json.dumps({"uid": f"p{i}", "step": i // 2 + 1}) + "\n" for i in range(10)))
    assert checkpoint.truncate_log(log, 3) == 4
    assert [json.loads(x)["uid"] for x in log.read_text().splitlines()] == [f"p{i}" for i in range(6)]
    assert checkpoint.truncate_log(tmp_path / "missing.jsonl", 3) == 0


def test_watchdog_fires_with_a_report(tmp_path):
    fired = []
    dog = Watchdog(
        0.3,
        lambda: {"rollouter": {"generating": 8, "queued": 0}, "last_push": {"version": 3}},
        tmp_path / "stall_report.json",
        on_stall=fired.append,
        poll_s=0.05,
    ).start()
    dog.phase("waiting for 8 finished groups for step 4")
    for step in range(1, 4):  # steps keep completing: no report
        time.sleep(0.15)
        dog.step_done(step)
    assert not fired
    deadline = time.monotonic() + 5
    while not fired and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fired, "the watchdog did not fire"
    rep = json.loads((tmp_path / "stall_report.json").read_text())
    assert rep["last_step"] == 3 and rep["trainer"]["phase"].startswith("waiting for 8 finished groups")
    assert rep["rollouter"]["generating"] == 8 and "train.stall_timeout_s=0.3" in rep["error"]
    assert "waiting for 8 finished groups" in summarize(rep)


def test_watchdog_report_failure_still_reports(tmp_path):
    def broken():
        raise TimeoutError("hub did not answer")

    dog = Watchdog(0.01, broken, tmp_path / "r.json", on_stall=lambda r: None)
    time.sleep(0.05)
    rep = dog.check()
    assert rep is not None and "hub did not answer" in rep["report_error"]


# ------------------------------------------------------------------ checkpoints: write, seal, verify, fall back


class _Learner:
    """What checkpoint.save/load touch: a model, its optimizer and scheduler (one process, no FSDP)."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(8, 4)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0 / (s + 1))
        self.model(torch.ones(2, 8)).sum().backward()
        self.opt.step()
        self.sched.step()


def _save(root: Path, step: int, pipeline: dict | None = None, config: dict | None = None) -> Path:
    """A checkpoint as a run writes it: saved, copied into the run's storage, sealed with its manifest."""
    path = root / f"step_{step:06d}_{1000 + step}"
    files = checkpoint.save(
        _Learner(step), path, 0, {"step": step, "version": step, "world": 1}, pipeline or {"epoch": 0}, config
    )
    checkpoint.write_manifest(path, files, step)
    return path


def _run(tmp_path: Path, steps=(2, 4, 6)) -> tuple[Path, list[Path]]:
    root = tmp_path / "run" / "ray_train" / "run"
    return tmp_path / "run", [_save(root, s, {"epoch": 0, "cursor": s}) for s in steps]


def test_save_seal_verify_and_load(tmp_path):
    path = _save(tmp_path, 3, {"epoch": 1, "cursor": 7}, {"config": {"seed": 1}})
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())
    assert set(manifest["files"]) >= {
        "state.json",
        "pipeline.json",
        "config.json",
        "rank0.pt",
        "model/.metadata",
    }
    assert all(len(f["sha256"]) == 64 and f["size"] > 0 for f in manifest["files"].values())
    assert checkpoint.verify(path) == []
    fresh = _Learner(99)
    saved = checkpoint.load(fresh, path, 0)
    assert saved["step"] == 3 and saved["pipeline"] == {"epoch": 1, "cursor": 7}
    assert saved["config"] == {"config": {"seed": 1}}
    assert torch.equal(fresh.model.weight, _Learner(3).model.weight)
    assert not list(path.glob(".*tmp*"))  # the atomic writes left no temporary file


def test_rank0_never_saves_without_the_pipeline(tmp_path):
    with pytest.raises(ValueError, match="pipeline"):
        checkpoint.save(_Learner(0), tmp_path / "c", 0, {"step": 1}, None)


def test_the_manifest_is_refused_where_a_rank_part_did_not_arrive(tmp_path):
    path = tmp_path / "step_000002_1"
    files = checkpoint.save(_Learner(2), path, 0, {"step": 2}, {"epoch": 0})
    files["rank1.pt"] = {"size": 10, "sha256": "0" * 64}  # another rank's part, never copied
    with pytest.raises(checkpoint.CheckpointError, match="rank1.pt: missing"):
        checkpoint.write_manifest(path, files, 2)
    assert not (path / checkpoint.MANIFEST).exists()
    assert checkpoint.verify(path)[0].file == checkpoint.MANIFEST  # unsealed: never restored


def _damage(path: Path, kind: str) -> str:
    shard = next(p for p in (path / "model").iterdir() if p.suffix == ".distcp")
    if kind == "missing pipeline":
        (path / checkpoint.PIPELINE).unlink()
        return "pipeline.json: missing"
    if kind == "empty state":
        (path / checkpoint.STATE).write_text("")
        return "state.json: size 0 bytes"
    if kind == "half shard":
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2])
        return f"model/{shard.name}: size {len(data) // 2} bytes"
    data = bytearray(shard.read_bytes())  # same size, one byte flipped
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return f"model/{shard.name}: checksum mismatch"


@pytest.mark.parametrize("kind", ["missing pipeline", "empty state", "half shard", "flipped byte"])
def test_resume_falls_back_past_a_damaged_checkpoint(tmp_path, caplog, kind):
    run, (a, b, c) = _run(tmp_path)
    said = _damage(c, kind)
    assert said in "; ".join(map(str, checkpoint.verify(c)))
    sel = checkpoint.select(run)
    assert (sel.path, sel.step, [p for p, _ in sel.skipped]) == (b, 4, [c])
    with caplog.at_level(logging.WARNING):
        assert checkpoint.find(run) == b
    (msg,) = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert str(c) in msg and said in msg and str(b) in msg
    assert checkpoint.select(c).path == b  # the damaged checkpoint named itself: the one before it
    assert checkpoint.select(a).path == a  # never a newer one than named


def test_no_complete_checkpoint_names_every_damaged_file(tmp_path):
    run, (a, b) = _run(tmp_path, (2, 4))
    _damage(a, "missing pipeline")
    _damage(b, "empty state")
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.select(run)
    assert f"{a}: pipeline.json: missing" in str(e.value) and f"{b}: state.json: size 0" in str(e.value)
    assert checkpoint.newest(run) is None
    with pytest.raises(FileNotFoundError, match="no such file"):
        checkpoint.select(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(checkpoint.ResumeError, match="no checkpoint in it"):
        checkpoint.select(tmp_path / "empty")
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text("{}")  # a run's final/: an HF model folder
    with pytest.raises(checkpoint.ResumeError, match=f"a model folder.*model.path={tmp_path / 'final'}"):
        checkpoint.select(tmp_path / "final")
    assert user_error(checkpoint.ResumeError("x")) is not None  # one line at the command line


def test_a_checkpoint_without_pipeline_is_never_loaded(tmp_path):
    path = _save(tmp_path, 2)
    (path / checkpoint.PIPELINE).unlink()
    with pytest.raises(checkpoint.CheckpointError, match="no pipeline.json.*train the epoch's prompts again"):
        checkpoint.load(_Learner(0), path, 0)


def _legacy(path: Path, step: int) -> Path:
    """A checkpoint written before manifests: the same files, no manifest, no format in state.json."""
    checkpoint.save(_Learner(step), path, 0, {"step": step, "world": 1}, {"epoch": 0})
    state = json.loads((path / checkpoint.STATE).read_text())
    del state["format"]
    (path / checkpoint.STATE).write_text(json.dumps(state))
    return path


def test_legacy_checkpoints_are_accepted_only_whole(tmp_path, caplog):
    root = tmp_path / "ray_train"
    a = _legacy(root / "step_000002_1", 2)
    b = _legacy(root / "step_000004_2", 4)
    sel = checkpoint.select(tmp_path)
    assert sel.path == b and sel.legacy
    with caplog.at_level(logging.WARNING):
        sel.warn()
    assert "before checkpoints had a manifest" in caplog.text
    (b / checkpoint.PIPELINE).write_text('{"epoch": ')  # cut short
    (a / "rank0.pt").unlink()
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.select(tmp_path)
    assert "pipeline.json: does not parse" in str(e.value) and "rank0.pt: missing" in str(e.value)


def test_a_new_checkpoint_without_its_manifest_is_incomplete(tmp_path):
    path = tmp_path / "step_000002_1"
    checkpoint.save(_Learner(2), path, 0, {"step": 2, "world": 1}, {"epoch": 0})  # never sealed
    (damage,) = checkpoint.verify(path)
    assert damage.file == checkpoint.MANIFEST and "did not finish" in damage.problem


def test_truncated_manifest_is_damage(tmp_path):
    path = _save(tmp_path, 2)
    (path / checkpoint.MANIFEST).write_text("{")
    (damage,) = checkpoint.verify(path)
    assert damage.file == checkpoint.MANIFEST and "unreadable" in damage.problem


# ------------------------------------------------------------------ --resume's config check


def _model(folder: Path, hidden: int = 128) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(
        json.dumps({"model_type": "qwen2", "hidden_size": hidden, "num_hidden_layers": 2, "vocab_size": 64})
    )
    return str(folder)


def _identity(tmp_path: Path, model: str = "m", train: str = "train.jsonl", hidden: int = 128, **cfg) -> dict:
    data = tmp_path / train
    if not data.exists():
        data.write_text(json.dumps({"prompt": train, "answer": "1"}) + "\n")
    config = {
        "model": {"path": f"./{model}", "dtype": "float32", "cache_dir": "x"},
        "data": {"train": train, "val": "builtin:arith", "epochs": 1},
        "train": {"lr": 1e-3, "steps": 10, "resume": ""},
        "ray": {"name": "a"},
    }
    for key, value in cfg.items():
        section, name = key.split("__")
        config[section][name] = value
    return resume_check.identity(config, _model(tmp_path / model, hidden), str(data), "/cache/val.jsonl")


def _ckpt_with(tmp_path: Path, identity: dict) -> Path:
    path = tmp_path / "ckpt"
    path.mkdir(exist_ok=True)
    (path / checkpoint.CONFIG).write_text(json.dumps(identity))
    return path


def test_resume_refuses_another_model_naming_both(tmp_path):
    ckpt = _ckpt_with(tmp_path, _identity(tmp_path))
    with pytest.raises(resume_check.ResumeMismatch) as e:
        resume_check.check(ckpt, _identity(tmp_path, model="other"), new_data_ok=True)
    assert "'./m'" in str(e.value) and "'./other'" in str(e.value) and "model.path" in str(e.value)
    # the same folder rebuilt with other shapes: the shape named
    with pytest.raises(resume_check.ResumeMismatch, match="hidden_size: 128 in the checkpoint, 256"):
        resume_check.check(ckpt, _identity(tmp_path, hidden=256), new_data_ok=True)
    with pytest.raises(resume_check.ResumeMismatch, match="model.dtype: .* float32, this run gives bfloat16"):
        resume_check.check(ckpt, _identity(tmp_path, model__dtype="bfloat16"), new_data_ok=True)
    builtin = {**_identity(tmp_path), "model": resume_check.model_identity("builtin:tiny", "/c/a", "float32")}
    other = {**builtin, "model": resume_check.model_identity("builtin:tiny-calc", "/c/b", "float32")}
    with pytest.raises(resume_check.ResumeMismatch, match="'builtin:tiny'.*'builtin:tiny-calc'"):
        resume_check.check(_ckpt_with(tmp_path, builtin), other, new_data_ok=True)


def test_resume_refuses_new_data_unless_asked(tmp_path, caplog):
    ckpt = _ckpt_with(tmp_path, _identity(tmp_path))
    new = _identity(tmp_path, train="new.jsonl")
    with pytest.raises(resume_check.ResumeMismatch, match="--resume-with-new-data") as e:
        resume_check.check(ckpt, new, new_data_ok=False)
    assert "'train.jsonl'" in str(e.value) and "'new.jsonl'" in str(e.value)
    with caplog.at_level(logging.WARNING):
        assert resume_check.check(ckpt, new, new_data_ok=True) is True
    assert "queue is dropped" in caplog.text
    # the same file, moved: no change; the file edited in place: a change
    (tmp_path / "moved").mkdir()
    (tmp_path / "moved" / "train.jsonl").write_bytes((tmp_path / "train.jsonl").read_bytes())
    assert (
        resume_check.check(ckpt, _identity(tmp_path, train="moved/train.jsonl"), new_data_ok=False) is False
    )
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "edited", "answer": "2"}) + "\n")
    with pytest.raises(resume_check.ResumeMismatch, match="sha256"):
        resume_check.check(ckpt, _identity(tmp_path), new_data_ok=False)


def test_resume_lists_other_changes_in_one_warning(tmp_path, caplog):
    ckpt = _ckpt_with(tmp_path, _identity(tmp_path))
    now = _identity(tmp_path, train__lr=5e-4, train__steps=20, ray__name="b", model__cache_dir="y")
    with caplog.at_level(logging.WARNING):
        assert resume_check.check(ckpt, now, new_data_ok=False) is False
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "2 config changes" in msg and "train.lr: 0.001 -> 0.0005" in msg and "train.steps: 10 -> 20" in msg
    assert "ray.name" not in msg and "cache_dir" not in msg  # where the run is hosted: not a change


def test_a_run_saved_under_the_old_lora_names_resumes(tmp_path, caplog):
    """A checkpoint whose config has the flat `model.lora_*` keys is compared under `model.lora.*`: the same
    settings resume without a change listed, another rank is refused naming the present key."""
    from app.config import load_config, to_container

    data, model = tmp_path / "train.jsonl", _model(tmp_path / "m")
    data.write_text(json.dumps({"prompt": "1+1", "answer": "2"}) + "\n")

    def ident(config: dict) -> dict:
        return resume_check.identity(config, model, str(data), "/cache/val.jsonl")

    saved = to_container(load_config(None, ["model.lora.rank=8", "model.lora.targets=q_proj"]))
    saved["model"].update({f"lora_{k}": v for k, v in saved["model"].pop("lora").items()})  # the old layout
    assert saved["model"]["lora_rank"] == 8 and "lora" not in saved["model"]
    ckpt = _ckpt_with(tmp_path, ident(saved))
    now = to_container(load_config(None, ["model.lora.rank=8", "model.lora.targets=q_proj"]))
    with caplog.at_level(logging.WARNING):
        assert resume_check.check(ckpt, ident(now), new_data_ok=False) is False
    # no config change, and no old-name warning: the user did not write the saved config
    assert not caplog.records
    now["model"]["lora"]["rank"] = 16
    with pytest.raises(
        resume_check.ResumeMismatch, match="model.lora.rank: the checkpoint was saved with 8,"
    ):
        resume_check.check(ckpt, ident(now), new_data_ok=False)


def test_resume_compares_a_legacy_checkpoint_with_its_run_config(tmp_path, caplog):
    ckpt = tmp_path / "run" / "ray_train" / "run" / "step_000002_1"
    ckpt.mkdir(parents=True)
    (tmp_path / "run" / "config.yaml").write_text(
        "model:\n  path: builtin:tiny\n  dtype: float32\ndata:\n  train: builtin:arith\n  val: builtin:arith\n"
    )
    now = {
        "config": {"model": {"path": "builtin:tiny-calc"}},
        "model": resume_check.model_identity("builtin:tiny-calc", "/c/calc", "float32"),
        "data": {"train": {"spec": "builtin:arith", "path": "/c/t"}, "val": {"spec": "builtin:arith"}},
    }
    with pytest.raises(resume_check.ResumeMismatch, match="'builtin:tiny'.*'builtin:tiny-calc'"):
        resume_check.check(ckpt, now, new_data_ok=False)
    with caplog.at_level(logging.WARNING):
        assert resume_check.check(tmp_path / "bare", now, new_data_ok=False) is False
    assert "cannot be checked" in caplog.text


def test_data_changed_reads_the_run_identity(tmp_path):
    ckpt = _ckpt_with(tmp_path, _identity(tmp_path))
    run = tmp_path / "runB"
    run.mkdir()
    assert not resume_check.data_changed(ckpt, run)  # no identity: nothing to compare
    (run / resume_check.IDENTITY).write_text(json.dumps(_identity(tmp_path)))
    assert not resume_check.data_changed(ckpt, run)
    (run / resume_check.IDENTITY).write_text(json.dumps(_identity(tmp_path, train="new.jsonl")))
    assert resume_check.data_changed(ckpt, run)


def test_new_data_drops_the_old_queue_and_counts_it():
    partial = Prompt(uid="p1", prompt_ids=[1, 2], answer="1")
    snap = PipelineSnapshot(epoch=2, epoch_seen=["a", "b"], cursor=5, taken=40, version=7, pending=[partial])
    fresh, dropped = fresh_pipeline(snap)
    assert (fresh.epoch, fresh.epoch_seen, fresh.cursor, fresh.ready, fresh.pending) == (0, [], 0, [], [])
    assert (fresh.taken, fresh.version) == (40, 7)
    assert dropped == {"groups": 0, "prompts": 1, "partial": 0}
