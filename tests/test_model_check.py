"""app/model_check.py: a model folder whose config.json names an architecture transformers does not know
fails before anything starts, in one line naming model.path."""

from __future__ import annotations

import json

import pytest

from app.errors import UserError
from app.model_check import ModelTypeError, check_model_type


def _folder(tmp_path, config: dict | str):
    (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return str(tmp_path)


def test_known_model_type_passes(tmp_path):
    from transformers import LlamaConfig

    saved = tmp_path / "llama"
    LlamaConfig(vocab_size=40, hidden_size=64, num_hidden_layers=2, num_attention_heads=4).save_pretrained(
        saved
    )
    assert check_model_type(str(saved)) is None
    minimal = tmp_path / "qwen2"
    minimal.mkdir()
    assert check_model_type(_folder(minimal, {"model_type": "qwen2"})) is None  # the class's defaults fill in


def test_unknown_model_type_names_model_path(tmp_path):
    folder = _folder(tmp_path, {"model_type": "not-a-model", "hidden_size": 8})
    with pytest.raises(ModelTypeError) as e:
        check_model_type(folder)
    msg = str(e.value)
    assert isinstance(e.value, UserError)
    assert f"model.path={folder!r}" in msg and "'not-a-model'" in msg and "\n" not in msg
    with pytest.raises(ModelTypeError, match=r"model.path='Org/Name': model_type 'not-a-model'"):
        check_model_type(folder, spec="Org/Name")  # the user's spelling, not the resolved folder


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"hidden_size": 8}, "has no model_type"),
        ("{not json", "not a readable JSON file"),
    ],
)
def test_unusable_config_json(tmp_path, config, words):
    folder = _folder(tmp_path, config)
    with pytest.raises(ModelTypeError, match=words) as e:
        check_model_type(folder)
    assert str(e.value).startswith(f"model.path={folder!r}: ") and "\n" not in str(e.value)


def test_missing_config_json(tmp_path):
    with pytest.raises(ModelTypeError, match="not a readable JSON file"):
        check_model_type(str(tmp_path / "absent"))
