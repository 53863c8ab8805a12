import dataclasses
import typing

import pytest

from app.config import (
    ALL_KEYS,
    REFERENCE_PATH,
    ConfigError,
    RelayConfig,
    TrainConfig,
    constraint,
    describe,
    load_config,
    reference_markdown,
    to_container,
    typed,
)


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


def test_docs_config_reference_is_up_to_date():
    assert REFERENCE_PATH.read_text() == reference_markdown(), (
        "docs/config.md is stale: regenerate it with `.venv/bin/python -m app config --write`"
    )


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


BAD = [
    ("train.grad_clip=0", "train.grad_clip", "> 0"),
    ("train.grad_clip=-1", "train.grad_clip", "gradient ascent"),
    ("algorithm.max_log_ratio=0", "algorithm.max_log_ratio", "> 0"),
    ("algorithm.max_staleness=inf", "algorithm.max_staleness", ">= 0"),
    ("algorithm.max_staleness=-1", "algorithm.max_staleness", ">= 0"),
    ("reward.on_error=nan", "reward.on_error", "finite"),
    ("reward.on_error=-inf", "reward.on_error", "finite"),
    ("algorithm.val_temperature=-0.5", "algorithm.val_temperature", ">= 0"),
    ("train.betas=[0.9,1.0]", "train.betas", "[0, 1)"),
    ("train.betas=[-0.1,0.9]", "train.betas", "[0, 1)"),
    ("train.betas=[0.9]", "train.betas", "two numbers"),
    ("train.weight_decay=-0.01", "train.weight_decay", ">= 0"),
    ("train.warmup_steps=-1", "train.warmup_steps", ">= 0"),
    ("train.timeout_s=0", "train.timeout_s", "> 0"),
    ("train.stall_timeout_s=-5", "train.stall_timeout_s", "> 0"),
    ("sync.timeout_s=0", "sync.timeout_s", "> 0"),
    ("reward.timeout_s=0", "reward.timeout_s", "> 0"),
    ("rollout.join_timeout_s=0", "rollout.join_timeout_s", "> 0"),
    ("rollout.request_timeout_s=inf", "rollout.request_timeout_s", "> 0"),
    ("rollout.gpu_memory_utilization=0", "rollout.gpu_memory_utilization", "in (0, 1]"),
    ("rollout.gpu_memory_utilization=1.2", "rollout.gpu_memory_utilization", "in (0, 1]"),
    ("rollout.max_num_seqs=0", "rollout.max_num_seqs", ">= 1"),
    ("rollout.kv_cache_gib=0", "rollout.kv_cache_gib", "> 0"),
    ("rollout.target_ongoing_requests=0", "rollout.target_ongoing_requests", "> 0"),
    ("rollout.temperature=nan", "rollout.temperature", "> 0"),
    ("ray.num_cpus=0", "ray.num_cpus", ">= 1"),
    ("train.worker_cpus=-1", "train.worker_cpus", ">= 0"),
    ("rollout.replica_cpus=-0.5", "rollout.replica_cpus", ">= 0"),
    ("reward.worker_cpus=-1", "reward.worker_cpus", ">= 0"),
    ("ref.worker_gpus=-1", "ref.worker_gpus", ">= 0"),
    ("resources.train_cpus=-2", "resources.train_cpus", ">= 0"),
    ("tracking.log_samples=-1", "tracking.log_samples", ">= 0"),
    ("sync.bucket_mb=0", "sync.bucket_mb", "> 0"),
    ("algorithm.clip_ratio_c=1", "algorithm.clip_ratio_c", "> 1"),
    ("seed=-1", "seed", ">= 0"),
    ("rollout.partial=no", "rollout.partial", "choose exactly one of off, keep, resubmit"),
    ("rollout.partial=false", "rollout.partial", "choose exactly one of off, keep, resubmit"),
    ("rollout.partial=Off", "rollout.partial", "did you mean off"),
    ("algorithm.mode=fully-async", "algorithm.mode", "did you mean fully_async"),
    ("log_level=info", "log_level", "did you mean INFO"),
    ("reward.fn=exact_mach", "reward.fn", "did you mean exact_match"),
    ("reward.fn=tests.test_config:helpr", "reward.fn", "did you mean tests.test_config:helper"),
    ("reward.fn=no_such_module:f", "reward.fn", "cannot import module 'no_such_module'"),
    ("rollout.lengths=pareto:inf:3", "rollout.lengths", "finite"),
]


def helper(response: str, answer: str) -> float:
    """A reward function for the reward.fn tests."""
    return 0.0


@pytest.mark.parametrize(("override", "key", "fragment"), BAD)
def test_bad_settings_are_refused_at_load(override, key, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    msg = str(e.value)
    assert f"invalid value for '{key}'" in msg and fragment in msg, msg


@pytest.mark.parametrize("partial", ["off", "resubmit"])
def test_kept_kv_cache_needs_partial_keep(partial):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.recompute_kv=false", f"rollout.partial={partial}"])
    assert "invalid value for 'rollout.recompute_kv'" in str(e.value) and "set partial=keep" in str(e.value)
    assert (
        load_config(None, ["rollout.recompute_kv=false"]).rollout.recompute_kv is False
    )  # keep: the default


def test_range_message_names_value_range_and_fix():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.grad_clip=0"])
    assert str(e.value).startswith("invalid value for 'train.grad_clip': 0.0; must be > 0 (")
    assert "e.g. train.grad_clip=1.0 (the default)" in str(e.value)


def test_yaml_booleans_only_true_false(tmp_path):
    """Only exact choices pass: YAML 1.1's no/false no longer become `off`; bool keys keep their words."""
    for text in ("no", "false", "False", "OFF"):
        f = tmp_path / "c.yaml"
        f.write_text(f"rollout:\n  partial: {text}\n")
        with pytest.raises(ConfigError, match="rollout.partial"):
            load_config(str(f))
    cfg = load_config(
        None, ["rollout.ignore_eos=yes", "data.shuffle=off", "train.lr=1e-3", "tracking.run_name=no"]
    )
    assert cfg.rollout.ignore_eos is True and cfg.data.shuffle is False
    assert cfg.train.lr == 1e-3 and cfg.tracking.run_name == "no"
    assert load_config(None, ["tracking.uri="]).tracking.uri == ""


def test_yaml_duplicate_key_refused(tmp_path):
    f = tmp_path / "dup.yaml"
    f.write_text("train:\n  steps: 3\n  steps: 4\n")
    with pytest.raises(ConfigError, match="duplicate key 'steps'"):
        load_config(str(f))


def test_every_numeric_key_has_a_range():
    numeric = [
        k for k, default, _ in describe() if type(default) in (int, float) or k.endswith("clip_ratio_c")
    ]
    assert numeric and not [k for k in numeric if not constraint(k)], "declare a _RANGES entry for each"


def test_typed_gives_dataclasses_with_literal_choices():
    cfg = load_config(None, ["algorithm.mode=fully_async", "rollout.partial=off"])
    t = typed(cfg)
    assert isinstance(t, RelayConfig) and isinstance(t.train, TrainConfig)
    assert t.algorithm.mode == "fully_async" and t.rollout.partial == "off"
    assert typing.get_type_hints(TrainConfig)["backend"] == typing.Literal["auto", "gloo", "nccl"]
    assert typed(to_container(cfg)) == t  # what roles receive (a plain dict) types the same
    t.check()
    with pytest.raises(ConfigError, match="train.grad_clip"):
        dataclasses.replace(t, train=dataclasses.replace(t.train, grad_clip=0.0)).check()


def test_registry_choices_are_checked_against_the_registries():
    """algorithm.mode / algorithm.correction / env.name name registry keys: a typo is refused with the valid
    keys."""
    from app.envs import ENVIRONMENTS
    from app.trainer.losses import LOSSES
    from app.trainer.sources import SOURCES

    for key, registry in (
        ("algorithm.correction", LOSSES),
        ("algorithm.mode", SOURCES),
        ("env.name", ENVIRONMENTS),
    ):
        for name in registry:
            extra = {
                "fully_async": ["algorithm.max_staleness=1"],
                "openai_agent": ["env.agent=app.envs.agent.example:calc_agent"],
            }
            load_config(None, [f"{key}={name}", *extra.get(name, [])])
        with pytest.raises(ConfigError, match=key) as e:
            load_config(None, [f"{key}=not_a_{key.split('.')[1]}"])
        assert all(name in str(e.value) for name in registry)


def test_calc_preset_and_its_cross_checks():
    cfg = load_config("calc", [])
    assert cfg.env.name == "calculator" and cfg.model.path == "builtin:tiny-calc"
    with pytest.raises(ConfigError, match="env.name.*set env.name=calculator"):
        load_config("calc", ["env.name="])
    with pytest.raises(ConfigError, match="model.path.*builtin:tiny-calc"):
        load_config("calc", ["model.path=builtin:tiny"])
    with pytest.raises(ConfigError, match="env.max_total_tokens.*max_model_len"):
        load_config("calc", ["env.max_total_tokens=100"])


def test_cli_config_prints_the_reference():
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "app", "config"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout == reference_markdown()


def test_result_is_the_last_line_on_its_own(capsys):
    from app.__main__ import _emit_result

    _emit_result({"ok": True, "steps": 3})
    out = capsys.readouterr().out
    assert out == 'RESULT {"ok": true, "steps": 3}\n'


def test_vllm_rotary_reload_warning_filtered(caplog):
    import logging

    from app.infra.log_filters import VLLM_RELOAD_LOGGER, configure_logging, silence_vllm_reload_warnings

    silence_vllm_reload_warnings()
    silence_vllm_reload_warnings()  # idempotent
    logger = logging.getLogger(VLLM_RELOAD_LOGGER)
    assert len(logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=VLLM_RELOAD_LOGGER):
        logger.warning("%s: Failed to load weights", "RotaryEmbedding")
        logger.warning("%s: Failed to load weights", "Llama3RotaryEmbedding")
        logger.warning("%s: Failed to load weights", "QKVParallelLinear")  # real trouble: still shown
    assert [r.getMessage() for r in caplog.records] == ["QKVParallelLinear: Failed to load weights"]
    level = logging.getLogger().level
    try:
        assert configure_logging("warning") == "WARNING" and logging.getLogger().level == logging.WARNING
    finally:
        logging.getLogger().setLevel(level)
