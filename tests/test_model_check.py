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


def test_a_pass_is_remembered_per_config_and_release(tmp_path, monkeypatch):
    import transformers

    folder = tmp_path / "m"
    folder.mkdir()
    _folder(folder, {"model_type": "qwen2"})
    marks = tmp_path / "marks"
    check_model_type(str(folder), remember=marks)
    assert len(list(marks.iterdir())) == 1

    def refuse(*a, **k):
        raise AssertionError("checked again")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", refuse)
    check_model_type(str(folder), remember=marks)  # the same config.json and release: passes at once
    _folder(folder, {"model_type": "qwen2", "hidden_size": 64})  # another config.json: checked again
    with pytest.raises(ModelTypeError, match="checked again"):  # the refusal, as the check reports it
        check_model_type(str(folder), remember=marks)


def test_a_failure_is_not_remembered(tmp_path):
    folder = _folder(tmp_path, {"model_type": "not-a-model"})
    for _ in range(2):
        with pytest.raises(ModelTypeError):
            check_model_type(folder, remember=tmp_path / "marks")
    assert not (tmp_path / "marks").exists()
