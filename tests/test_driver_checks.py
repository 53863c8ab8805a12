"""The driver's checks before and during start-up, at unit level (no Ray): a context longer than the model's
positions is refused before anything starts, and a deployment that fails to start reports the replica's own
reason, not only Serve's "Failed to update the deployments"."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from app.config import load_config
from app.driver import check_context, failure_reason


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
