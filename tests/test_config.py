import pytest

from app.config import ALL_KEYS, ConfigError, describe, load_config


def test_defaults_validate():
    cfg = load_config()
    assert cfg.algorithm.mode == "sync"
    assert cfg.train.workers == 2


def test_overrides_and_types():
    cfg = load_config(None, ["train.steps=7", "algorithm.mode=one_step_off", "train.betas=[0.8,0.9]"])
    assert cfg.train.steps == 7 and cfg.algorithm.mode == "one_step_off"
    assert list(cfg.train.betas) == [0.8, 0.9]


def test_unknown_key_names_key_and_suggests():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.stepz=3"])
    msg = str(e.value)
    assert "train.stepz" in msg and "train.steps" in msg


def test_unknown_section():
    with pytest.raises(ConfigError, match="unknown config key 'trainer.steps'"):
        load_config(None, ["trainer.steps=3"])


def test_invalid_choice_lists_choices():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["algorithm.mode=async"])
    assert "algorithm.mode" in str(e.value) and "one_step_off" in str(e.value)


def test_wrong_type():
    with pytest.raises(ConfigError, match="train.steps"):
        load_config(None, ["train.steps=many"])


def test_range_checks():
    with pytest.raises(ConfigError, match="rollout.n"):
        load_config(None, ["rollout.n=1"])
    with pytest.raises(ConfigError, match="rollout.max_replicas"):
        load_config(None, ["rollout.min_replicas=3", "rollout.max_replicas=2"])
    with pytest.raises(ConfigError, match="max_model_len"):
        load_config(None, ["rollout.max_model_len=16"])


def test_override_without_equals():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["train.steps"])


def test_yaml_file_and_unknown_key_in_file(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("train:\n  steps: 11\n")
    assert load_config(str(good), ["train.lr=0.01"]).train.steps == 11
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  stepps: 11\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(bad))
    assert "stepps" in str(e.value) and "bad.yaml" in str(e.value)


def test_presets_load():
    for name in ("default", "one_step_off", "quick"):
        load_config(name)
    with pytest.raises(ConfigError, match="presets"):
        load_config("nope")


def test_every_key_documented():
    keys = {k for k, _, _ in describe()}
    leaves = {k for k in ALL_KEYS if not any(o.startswith(k + ".") for o in ALL_KEYS)}
    assert keys == leaves
    undocumented = [k for k, _, doc in describe() if not doc]
    assert not undocumented, f"document these keys in app/config.py: {undocumented}"


def test_readme_documents_every_key():
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    missing = [k for k, _, _ in describe() if f"`{k}`" not in readme]
    assert not missing, f"README's config reference lacks {missing}: regenerate with `python -m app config`"


def test_cli_bad_key_exits_2_with_message():
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-m", "app", "train", "train.stepz=3"], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 2
    assert "unknown config key 'train.stepz'" in p.stderr and "train.steps" in p.stderr


def test_builtin_code_task_needs_a_real_model():
    with pytest.raises(ConfigError, match="builtin:code needs a tokenizer that can write programs"):
        load_config(None, ["data.train=builtin:code"])
    cfg = load_config("code", [])  # the preset: the ASCII tiny model, sandbox rewards on a worker
    assert cfg.model.path == "builtin:tiny-code" and cfg.reward.workers == 1


def test_partial_off_survives_yaml_booleans(tmp_path):
    """`rollout.partial=off` (and `partial: off` in a YAML file) is the string 'off', not YAML's false."""
    assert load_config(None, ["rollout.partial=off"]).rollout.partial == "off"
    f = tmp_path / "c.yaml"
    f.write_text("rollout:\n  partial: off\n")
    assert load_config(str(f), []).rollout.partial == "off"
