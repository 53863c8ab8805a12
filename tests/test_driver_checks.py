"""The driver's checks before and during start-up, at unit level (no Ray): a context longer than the model's
positions is refused before anything starts, and a deployment that fails to start reports the replica's own
reason, not only Serve's "Failed to update the deployments"."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from app.config import load_config
from app.driver import check_context
from app.rollout.start_watch import failure_reason


def test_a_context_over_the_models_positions_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    with pytest.raises(ValueError, match=r"rollout.max_model_len=128 .* max_position_embeddings=64.*set"):
        check_context(load_config(None, ["rollout.max_model_len=128"]), str(tmp_path))
    check_context(load_config(None, ["rollout.max_model_len=64", "data.max_prompt_tokens=32"]), str(tmp_path))
    # rope scaling stretches the context: vLLM decides
    (tmp_path / "config.json").write_text(
        json.dumps({"max_position_embeddings": 64, "rope_scaling": {"factor": 4}})
    )
    check_context(load_config(None, ["rollout.max_model_len=128"]), str(tmp_path))


def test_a_failed_deployment_reports_the_replicas_reason():
    tb = (
        "The deployment failed to start 3 times in a row. This may be due to a problem with its constructor.\n"
        "Traceback (most recent call last):\n"
        '  File "app/serve_rollout.py", line 64, in __init__\n'
        "    self.engine = vla.create_engine(model_path, **engine, partial=partial)\n"
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
        "  Value error, User-specified max_model_len (128) is greater than the derived max_model_len (64)\n"
    )
    st = SimpleNamespace(
        message="Failed to update the deployments ['rollout'].",
        deployments={"rollout": SimpleNamespace(message=tb)},
    )
    why = failure_reason(st)
    assert why.startswith("Failed to update the deployments") and "rollout: pydantic_core" in why
    assert "ValidationError" in why
    bare = SimpleNamespace(message="Failed to update the deployments ['rollout'].", deployments={})
    assert failure_reason(bare) == bare.message


def _result(capsys) -> tuple[dict, str]:
    out, err = capsys.readouterr()
    (line,) = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :]), err


@pytest.mark.parametrize(
    "args, says",
    [
        (["--resume", "{tmp}/nope"], "no such file or directory; give a run's folder"),
        (["--resume", "{tmp}/final"], "a model folder, not a checkpoint.*model.path={tmp}/final"),
        (["data.train={tmp}/missing.jsonl"], "missing.jsonl"),
        (["data.train={tmp}/bad.jsonl"], "bad.jsonl"),
    ],
)
def test_input_errors_before_anything_starts_are_one_line_and_exit_2(args, says, tmp_path, capsys):
    """A resume of something that is not a run, a missing data file, a malformed row: each is one line
    naming the fix and exit code 2 (as a config error), with no traceback, before Ray or the model."""
    from app.__main__ import main

    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text("{}")  # a run's final/: an HF model folder
    (tmp_path / "bad.jsonl").write_text('{"prompt": "2+2=", "answer": "4"}\n{"question": "no prompt"}\n')
    argv = ["train", *(a.replace("{tmp}", str(tmp_path)) for a in args), f"run_dir={tmp_path / 'runs'}"]
    assert main(argv) == 2
    res, err = _result(capsys)
    assert res["ok"] is False and re.search(says.replace("{tmp}", str(tmp_path)), res["error"]), res
    assert "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # no run folder, no MLflow run
