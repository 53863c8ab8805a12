import dataclasses
import logging
import typing
from pathlib import Path

import pytest

from app.__main__ import main
from app.config import (
    ALL_KEYS,
    REFERENCE_PATH,
    ConfigError,
    RelayConfig,
    TrainConfig,
    constraint,
    describe,
    reference_markdown,
    to_container,
    typed,
)
from app.preflight import load_config


def test_defaults_validate():
    cfg = load_config()
    assert cfg.algorithm.mode == "sync"
    assert cfg.train.workers == 1


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
    with pytest.raises(ConfigError, match="unknown config key 'trainer.steps'") as e:
        load_config(None, ["trainer.steps=3"])
    assert "Valid sections: model, data, rollout, train," in str(e.value)


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
    assert not undocumented, f"document these keys in app/config/: {undocumented}"


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
    ("sync.broadcast.bucket_mb=0", "sync.broadcast.bucket_mb", "> 0"),
    ("sync.ipc.bucket_mb=-1", "sync.ipc.bucket_mb", "> 0"),
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
                "openai_agent": ["env.agent=app.agent.example:calc_agent"],
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


# ------------------------------------------------------------------ errors through the command line


def _cli(*argv: str) -> tuple[int, str, str]:
    """`python -m app ...` in a subprocess (its real stdout and stderr): exit code, stdout, stderr."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    p = subprocess.run(
        [sys.executable, "-m", "app", *argv], capture_output=True, text=True, timeout=120, cwd=root, env=env
    )
    return p.returncode, p.stdout, p.stderr


def _result(stdout: str) -> dict:
    import json

    last = stdout.rstrip("\n").splitlines()[-1]
    assert last.startswith("RESULT "), stdout
    return json.loads(last[len("RESULT ") :])


def test_cli_section_typo_names_the_valid_sections_and_prints_result():
    rc, out, err = _cli("train", "--print-config", "trian.steps=3")
    assert rc == 2
    res = _result(out)
    assert res["ok"] is False and "there is no section 'trian'" in res["error"]
    assert "Did you mean train.steps" in res["error"]
    assert "Valid sections: model, data, rollout, train, algorithm" in res["error"]
    assert "Valid sections: model" in err and err.count("\n") == 1, err  # one line on stderr


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "train.betas=0.9",
            "expected a list in brackets of numbers, e.g. train.betas=[0.9,0.99] (the default)",
        ),
        ("train.betas=[a,b]", "expected a list in brackets of numbers"),
        ("train.steps=many", "expected an integer, e.g. train.steps=60 (the default)"),
        ("train.use_gpu=maybe", "expected true or false, e.g. train.use_gpu=false"),
        ("rollout.gpu_memory_utilization=x", "expected a number, or null"),
        ("resources.rollout_custom=3", "expected a mapping in braces of names to numbers"),
        (
            "model=3",
            "it is a section, not a value; set its keys (e.g. model.path=...). Valid keys in section",
        ),
        ("data.nope=1", "Valid keys in section 'data': data.train, data.train_weights, data.val"),
        ("nope=1", "Valid keys at the top level: model, data,"),
        (
            "model.path=builtin:tinyy",
            "choose exactly one of builtin:tiny, builtin:tiny-code, builtin:tiny-calc",
        ),
        (
            "data.val=builtin:arth",
            "choose exactly one of builtin:arith, builtin:wordproblems, builtin:mathproblems, builtin:code",
        ),
    ],
)
def test_wrong_values_say_what_is_expected(override, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    msg = str(e.value)
    assert expected in msg and "AnyNode" not in msg and "ListConfig" not in msg, msg


def test_wrong_type_in_a_config_file_names_key_and_expectation(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  betas: 0.9\n")
    with pytest.raises(ConfigError, match=r"'train.betas': expected a list in brackets of numbers.*c.yaml"):
        load_config(str(f), [])
    f.write_text("trian:\n  steps: 3\n")
    with pytest.raises(ConfigError, match="unknown config key 'trian'.*Valid keys at the top level: model"):
        load_config(str(f), [])


def test_builtin_tasks_are_checked_against_their_registry_entries():
    """app/tasks' registry says which built-in models can write a task and which environments answer it."""
    from app.tasks import task_problems

    with pytest.raises(
        ConfigError, match=r"'model\.path': builtin:tiny: builtin:calc needs a tokenizer with the"
    ):
        load_config(None, ["data.train=builtin:calc", "data.val=builtin:calc", "env.name=calculator"])
    with pytest.raises(
        ConfigError, match=r"'env\.name': '': builtin:calc is answered with a tool; set env\.name="
    ):
        load_config(None, ["data.train=builtin:calc", "model.path=builtin:tiny-calc"])
    assert load_config("calc", []).data.train == "builtin:calc"  # the preset sets it up
    assert task_problems("Qwen/Qwen2.5-0.5B", "calculator", ["builtin:calc"]) == []  # a real model may
    assert task_problems("builtin:tiny-code", "", ["builtin:arith", "x.jsonl"]) == []
    assert [k for k, _ in task_problems("builtin:tiny", "", ["builtin:code", "builtin:calc"])] == [
        "model.path",
        "model.path",
        "env.name",
    ]


def test_user_error_is_one_line_with_the_traceback_only_at_debug(tmp_path):
    """A missing data file: one line naming the file and the fix, RESULT ok=false, exit 2 (an input error,
    as a config error); at DEBUG, the traceback."""
    val = tmp_path / "val.jsonl"
    val.write_text('{"prompt": "q", "answer": "1"}\n')
    args = ["train", f"data.train={tmp_path / 'missing.jsonl'}", f"data.val={val}", f"run_dir={tmp_path}"]
    rc, out, err = _cli(*args)
    assert rc == 2 and "missing.jsonl: file not found" in _result(out)["error"]
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "ERROR" in lines[0] and "check data.train" in lines[0], err
    assert "Traceback" not in err
    rc, out, err = _cli(*args, "log_level=DEBUG")
    assert rc == 2 and "Traceback (most recent call last)" in err and "DataError" in err


def test_user_error_found_inside_a_wrapping_exception():
    from app.errors import user_error
    from app.rollout.prompt_files import DataError

    inner = DataError("f.jsonl row 3: missing key 'prompt'")

    class TaskError(RuntimeError):  # Ray's RayTaskError keeps what the task raised as `cause`
        def __init__(self, cause):
            super().__init__("task failed")
            self.cause = cause

    assert user_error(TaskError(inner)) is inner
    try:
        try:
            raise inner
        except DataError as e:
            raise RuntimeError("while starting the rollouter") from e
    except RuntimeError as outer:
        assert user_error(outer) is inner
    assert user_error(RuntimeError("a crash")) is None


# ------------------------------------------------------------------ presets for real work


def test_real_model_with_toy_settings_is_refused_naming_every_fix():
    rc, out, _ = _cli(
        "train",
        "--print-config",
        "model.path=/models/Qwen2.5-0.5B-Instruct",
        "data.train=/d/t.parquet",
    )
    msg = _result(out)["error"]
    assert rc == 2
    for part in (
        "data.val=builtin:arith",
        "data.max_prompt_tokens=64 (e.g. data.max_prompt_tokens=512)",
        "rollout.max_tokens=8",
        "train.lr=0.001 (e.g. train.lr=1e-6)",
        "model.dtype=float32 (e.g. model.dtype=bfloat16)",
        "vLLM or the trainer on CPU",
        "`--config gsm8k` or `--config math` on GPUs, `--config laptop`",
        "model.allow_toy_settings=true",
    ):
        assert part in msg, (part, msg)
    assert "data.train=" not in msg.split("toy settings:")[1].split(";")[0]  # the user's file is no toy


def test_real_model_with_builtin_val_alone_is_refused():
    with pytest.raises(ConfigError) as e:
        load_config("gsm8k", ["model.path=/models/m", "data.val=builtin:arith"])
    msg = str(e.value)
    assert "data.val=builtin:arith" in msg and "max_prompt_tokens" not in msg, msg


def test_allow_toy_settings_keeps_them_on_purpose():
    cfg = load_config(None, ["model.path=/models/m", "model.allow_toy_settings=true"])
    assert cfg.model.path == "/models/m" and cfg.data.val == "builtin:arith"


def test_math_preset_runs_a_real_model_without_a_hub_or_files():
    """`--config math` as it stands: SmolLM2-135M on the built-in MATH-layout problems with the math reward;
    the real MATH with a 1.5B model is the overrides its header names."""
    cfg = load_config("math", [])
    assert cfg.model.path == "builtin:smollm2-135m" and cfg.model.dtype == "bfloat16"
    assert cfg.data.train == cfg.data.val == "builtin:mathproblems" and cfg.reward.fn == "math_shaped"
    assert cfg.rollout.cuda_graphs and cfg.train.lr == 1e-5
    real = load_config(
        "math",
        [
            "model.path=Qwen/Qwen2.5-1.5B-Instruct",
            "train.lr=1e-6",
            "data.train=m/train.parquet",
            "data.val=m/test.parquet",
            "data.val_size=500",
            "rollout.max_tokens=3072",
            "rollout.max_model_len=4096",
        ],
    )
    assert real.model.path == "Qwen/Qwen2.5-1.5B-Instruct" and real.data.val_size == 500


def test_gsm8k_preset_runs_a_real_model_without_a_hub_or_files():
    """`--config gsm8k` as it stands: SmolLM2-135M on the built-in word problems, with the shaped reward, CUDA
    graphs and an lr that moves a small model; the real GSM8K is two overrides away."""
    cfg = load_config("gsm8k", [])
    assert cfg.model.path == "builtin:smollm2-135m" and cfg.model.dtype == "bfloat16"
    assert cfg.data.train == cfg.data.val == "builtin:wordproblems" and cfg.data.val_size == 0
    assert cfg.reward.fn == "gsm8k_shaped" and cfg.rollout.cuda_graphs and cfg.train.lr == 1e-5
    real = load_config(
        "gsm8k",
        ["model.path=Qwen/Qwen2.5-0.5B-Instruct", "data.train=g/train.parquet", "data.val=g/test.parquet"],
    )
    assert real.data.train == "g/train.parquet" and real.model.path == "Qwen/Qwen2.5-0.5B-Instruct"


def test_laptop_preset_is_a_real_model_on_cpu():
    """A real model on CPU cores with real data, lengths and lr is no toy run (float32 and the CPU placement
    count as toy settings only beside a toy dataset, length or lr)."""
    cfg = load_config("laptop", [])
    assert cfg.model.path == "builtin:smollm2-135m" and cfg.model.dtype == "float32"
    assert cfg.rollout.replica_gpus == 0 and not cfg.train.use_gpu and cfg.resources.rollout_gpus == 0
    assert load_config("laptop", ["model.path=/models/small"]).model.path == "/models/small"
    with pytest.raises(ConfigError, match="rollout.max_tokens=8"):
        load_config("laptop", ["rollout.max_tokens=8", "model.path=/models/small"])


def test_tiny_models_refuse_the_real_task():
    with pytest.raises(
        ConfigError, match=r"builtin:wordproblems needs a real tokenizer.*builtin:smollm2-135m"
    ):
        load_config(None, ["data.train=builtin:wordproblems", "data.val=builtin:wordproblems"])


def test_a_gpu_preset_on_a_machine_without_a_gpu_is_refused_in_one_line():
    from app.infra.resources import ResourceError, check_local_gpus

    with pytest.raises(ResourceError, match=r"this machine has no GPU.*--config laptop"):
        check_local_gpus(load_config("gsm8k", []), 0)
    check_local_gpus(load_config("gsm8k", []), 1)  # a GPU: fine
    check_local_gpus(load_config("laptop", []), 0)  # the CPU preset: fine
    check_local_gpus(load_config(None, []), 0)  # the embedded default: fine


@pytest.mark.parametrize(
    "gpus, replicas, replica_gpus, workers, worker_gpus",
    [(1, 1, 0.5, 1, 0.5), (2, 1, 1.0, 1, None), (4, 2, 1.0, 2, None), (8, 4, 1.0, 4, None)],
)
def test_preset_placement_follows_the_cluster(gpus, replicas, replica_gpus, workers, worker_gpus):
    from app.infra.resources import resolve

    got = resolve(load_config("gsm8k", []), {"CPU": 16 * gpus, "GPU": gpus})
    assert got["rollout.min_replicas"] == got["rollout.max_replicas"] == replicas
    assert got["rollout.replica_gpus"] == replica_gpus
    assert got["train.use_gpu"] is True and got["train.workers"] == workers
    assert got.get("train.worker_gpus") == worker_gpus


# ------------------------------------------------------------------ model paths


def _hub_cache(root, repo="Org/Tiny-Model", rev="0123abcd"):
    snap = root / f"models--{repo.replace('/', '--')}" / "snapshots" / rev
    snap.mkdir(parents=True)
    (snap / "config.json").write_text('{"model_type": "qwen2", "max_position_embeddings": 4096}')
    (root / f"models--{repo.replace('/', '--')}" / "refs").mkdir()
    (root / f"models--{repo.replace('/', '--')}" / "refs" / "main").write_text(rev)
    return snap


def test_hub_id_resolves_from_the_local_hf_cache(tmp_path, monkeypatch):
    from app.driver import resolve_inputs

    snap = _hub_cache(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network: found in the cache or refused
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "q", "answer": "1"}\n')
    cfg = load_config("gsm8k", ["model.path=Org/Tiny-Model", f"data.train={data}", f"data.val={data}"])
    assert resolve_inputs(cfg).model_path == str(snap.resolve())


def test_hub_cache_from_hf_home_and_newest_snapshot_without_ref(tmp_path, monkeypatch):
    from app.model_path import resolve_model_path

    snap = _hub_cache(tmp_path / "home" / "hub", "Org/M", "r1")
    (snap.parent.parent / "refs" / "main").unlink()
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert resolve_model_path("Org/M") == str(snap)


def test_hub_id_not_cached_offline_says_where_it_looked_and_the_fix(tmp_path, monkeypatch):
    from app.model_path import ModelPathError, resolve_model_path

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelPathError) as e:
        resolve_model_path("Org/Absent")
    msg = str(e.value)
    assert str(tmp_path / "empty") in msg and "hf download Org/Absent" in msg and "HF_HUB_OFFLINE" in msg


def test_model_path_expands_home_and_names_the_fix(tmp_path, monkeypatch):
    from app.model_path import ModelPathError, resolve_model_path

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "models" / "m" / "config.json").write_text("{}")
    assert resolve_model_path("~/models/m") == str(tmp_path / "models" / "m")
    with pytest.raises(
        ModelPathError, match=r"has no config.json.*hub id such as Qwen/Qwen2.5-0.5B-Instruct"
    ):
        resolve_model_path(str(tmp_path / "models"))
    with pytest.raises(ModelPathError, match="does not exist"):
        resolve_model_path("./no/such/place")


def test_a_real_model_may_run_colocated_on_every_gpu():
    """`resources.colocate` places vLLM and the trainer on GPUs: not the toy default's CPU placement."""
    cfg = load_config(
        "gsm8k", ["resources.colocate=true", "resources.rollout_gpus=0", "resources.train_gpus=0"]
    )
    assert cfg.resources.colocate


def test_several_presets_merge_left_to_right_and_say_what_they_take_over(caplog):
    """`--config gsm8k --config lora`: LoRA on gsm8k's model and data, never silently only the last preset."""
    caplog.set_level(logging.INFO, logger="app.config.load")
    gsm8k, lora = load_config("gsm8k"), load_config("lora")
    both = load_config(["gsm8k", "lora"], ["train.steps=7"])
    assert both.model.path == gsm8k.model.path != lora.model.path
    assert both.data.train == gsm8k.data.train and both.reward.fn == gsm8k.reward.fn
    assert both.model.lora.rank == lora.model.lora.rank > 0 and both.train.lr == lora.train.lr
    assert both.train.steps == 7  # key=value still last
    (line,) = [r.getMessage() for r in caplog.records if "--config lora" in r.getMessage()]
    assert "train.lr" in line and line.endswith("over gsm8k")
    assert main(["train", "--config", "gsm8k", "--config", "lora", "--print-config"]) == 0


def test_the_build_cache_is_the_same_folder_from_any_working_directory(monkeypatch, tmp_path):
    from app.tasks import cache_root

    monkeypatch.delenv("RELAY_CACHE", raising=False)
    assert load_config().model.cache_dir == ""
    assert cache_root("") == Path("~/.cache/relay").expanduser()
    monkeypatch.setenv("RELAY_CACHE", str(tmp_path))
    assert cache_root("") == tmp_path
    assert cache_root("~/elsewhere") == Path.home() / "elsewhere"  # model.cache_dir wins


def test_a_bad_row_found_in_the_rollouters_constructor_is_the_same_one_line():
    """Ray keeps only the text of what an actor's `__init__` raised: the user error is found in it, so a bad
    row found after Ray started ends the run with the one line (file, row, fix) it would have before Ray."""
    import traceback

    from ray.exceptions import ActorDiedError, RayTaskError

    from app.errors import user_error
    from app.rollout.prompt_files import DataError

    msg = "/data/train.jsonl row 700: 'answer' is null; give every row an answer (data.answer_key)"
    try:
        raise DataError(msg)
    except DataError as e:
        died = ActorDiedError(RayTaskError("Rollouter.__init__", traceback.format_exc(), e))
    assert "creation task" in str(died) and str(user_error(died)) == msg
    assert user_error(ActorDiedError(RayTaskError("f", "tb", ValueError("a bug")))) is None
