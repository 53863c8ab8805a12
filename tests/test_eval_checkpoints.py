"""What `python -m app eval` evaluates (app/evaluation/checkpoints.py): an HF folder, a run directory's final/
export or newer checkpoint, and a sharded checkpoint exported to an HF folder (real torch.distributed.checkpoint
files, one process; no Ray, no vLLM)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from app.evaluation import checkpoints as ev
from app.trainer import checkpoint


def _model(folder: Path) -> Path:
    """A small Qwen2 HF folder with the tiny task's tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from app.tasks.tiny import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(str(folder), safe_serialization=True)
    tok.save_pretrained(str(folder))
    return folder


def _sharded_checkpoint(run: Path, base: Path, step: int) -> tuple[Path, dict[str, torch.Tensor]]:
    """A complete checkpoint of `step` under `run` (as a trainer saves it: model and optimizer through
    torch.distributed.checkpoint, state, pipeline, manifest) whose weights differ from `base`'s."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25)
    path = run / "ray_train" / run.name / f"step_{step:06d}_{int(time.time() * 1000)}"
    path.mkdir(parents=True)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    dcp.save({"model": sd, "optim": {}}, checkpoint_id=str(path / "model"))
    (path / checkpoint.STATE).write_text(json.dumps({"step": step, "format": checkpoint.FORMAT}))
    (path / checkpoint.PIPELINE).write_text("{}")
    checkpoint.write_manifest(path, checkpoint.describe(path), step)
    return path, sd


def _run_dir(tmp_path: Path, final_step: int | None) -> Path:
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("reward:\n  fn: exact_match\nrollout:\n  max_tokens: 8\n")
    (run / "run_identity.json").write_text("{}")
    if final_step is not None:
        _model(run / "final")
        (run / "summary.json").write_text(json.dumps({"steps": final_step}))
    return run


def test_an_hf_folder_is_evaluated_as_it_is(tmp_path):
    m = _model(tmp_path / "m")
    w = ev.locate(str(m))
    assert (w.path, w.hf, w.what) == (m, True, "HF folder")
    assert ev.run_config(str(m)) is None  # no Relay run wrote it


def test_a_run_directory_gives_its_final_export_unless_a_checkpoint_is_later(tmp_path):
    run = _run_dir(tmp_path, final_step=3)
    ck, _ = _sharded_checkpoint(run, run / "final", 3)  # the checkpoint the run's end saves with final/
    w = ev.locate(str(run))
    assert (w.path, w.hf, w.what) == (run / "final", True, "final export")
    assert ev.locate(str(run / "final")).what == "final export"
    cfg, where = ev.run_config(str(run))
    assert cfg["reward"]["fn"] == "exact_match" and where == run / "config.yaml"
    assert ev.run_config(str(run / "final"))[1] == run / "config.yaml"
    later, _ = _sharded_checkpoint(run, run / "final", 5)  # a resumed run saved step 5, then crashed
    w = ev.locate(str(run))
    assert (w.path, w.hf, w.what) == (later, False, "checkpoint of step 5")
    assert ev.locate(str(ck)).path == ck  # one checkpoint, named


def test_a_sharded_checkpoint_exports_to_an_hf_folder_with_its_weights(tmp_path):
    from safetensors.torch import load_file

    base = _model(tmp_path / "base")
    run = _run_dir(tmp_path, final_step=None)
    ck, sd = _sharded_checkpoint(run, base, 2)
    w = ev.locate(str(run))
    assert (w.path, w.hf) == (ck, False)
    out = ev.export_hf(ck, str(base), tmp_path / "exported", "bfloat16")
    assert ev.is_hf_folder(out) and (out / "tokenizer.json").exists()
    got = load_file(out / "model.safetensors")
    assert got["model.embed_tokens.weight"].dtype == torch.bfloat16
    for k, v in got.items():
        assert torch.equal(v, sd[k].to(torch.bfloat16)), k
    before = load_file(base / "model.safetensors")
    assert not torch.equal(before["model.norm.weight"].to(torch.bfloat16), got["model.norm.weight"])


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    base = _model(tmp_path / "base")
    run = _run_dir(tmp_path, final_step=None)
    ck, _ = _sharded_checkpoint(run, base, 2)
    other = tmp_path / "other"
    Qwen2ForCausalLM(
        Qwen2Config(**{**Qwen2Config.from_pretrained(base).to_dict(), "hidden_size": 128})
    ).save_pretrained(str(other))
    (other / "tokenizer.json").write_bytes((base / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match="does not hold the weights of"):
        ev.export_hf(ck, str(other), tmp_path / "x", "float32")


def test_nothing_to_evaluate_names_what_to_give(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        ev.locate(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="give a model folder, a run directory"):
        ev.locate(str(tmp_path / "empty"))
