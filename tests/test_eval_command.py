"""`python -m app eval`'s config (the run's settings inherited, --config replacing them), its own names, its
JSONL rows, and validation's per-source metrics (no Ray, no vLLM; the whole command runs in
tests/integration/test_eval.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from app.__main__ import _parser
from app.config import ConfigError, load_config
from app.evaluation import command
from app.evaluation.checkpoints import Weights
from app.evaluation.scores import PromptRewards, score
from app.records import Group, Sample
from app.trainer.validation import per_source


def _run(tmp_path: Path, *overrides: str) -> Path:
    """A run directory as training leaves it: its resolved config.yaml and identity."""
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    cfg = load_config(
        None, ["tracking.run_name=r1", "train.resume=/x", "ray.address=10.0.0.9:6379", *overrides]
    )
    (run / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    (run / "run_identity.json").write_text("{}")
    return run


def test_a_runs_settings_come_with_its_weights(tmp_path):
    run = _run(tmp_path, "reward.fn=exact_match", "rollout.max_tokens=6", "model.dtype=bfloat16")
    cfg = command.load(None, [f"eval.checkpoint={run}", "eval.n=2"])
    assert (cfg.reward.fn, cfg.rollout.max_tokens, cfg.model.dtype) == ("exact_match", 6, "bfloat16")
    assert cfg.eval.n == 2 and cfg.eval.checkpoint == str(run)
    # the run's own, not the evaluation's
    assert cfg.tracking.run_name == "" and cfg.train.resume == "" and cfg.ray.address == ""
    # an override wins over the run's settings; --config replaces them
    assert command.load(None, [f"eval.checkpoint={run}", "rollout.max_tokens=3"]).rollout.max_tokens == 3
    assert command.load("quick", [f"eval.checkpoint={run}"]).reward.fn == "auto"


def test_a_runs_settings_from_an_older_version_keep_what_this_one_knows(tmp_path):
    run = _run(tmp_path, "reward.fn=exact_match")
    text = (run / "config.yaml").read_text().replace("reward:\n", "reward:\n  retired_key: 3\n", 1)
    (run / "config.yaml").write_text(text + "retired_section:\n  x: 1\n")
    assert command.load(None, [f"eval.checkpoint={run}"]).reward.fn == "exact_match"


def test_a_bad_setting_of_the_run_names_the_run(tmp_path):
    run = _run(tmp_path)
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace("'n': 8", "'n': 1", 1))
    with pytest.raises(ConfigError, match=r"rollout.n.*in the settings of the run that wrote .*config.yaml"):
        command.load(None, [f"eval.checkpoint={run}"])


def test_the_evaluation_has_its_own_names_and_reads_every_prompt(tmp_path):
    cfg = load_config(None, ["data.val_size=8", "eval.data=/d/test.jsonl"])
    out = command._settings(cfg, Weights(tmp_path / "final", True, "final export"))
    assert out.data.val == out.data.train == "/d/test.jsonl" and out.data.val_size == 0
    assert out.ray.name == "relay-eval" and out.tracking.run_name.startswith("eval-")
    assert out.model.path == str(tmp_path / "final")
    # nothing trains: the start-up checks count no trainer, reference workers or NCCL weight group
    assert out.train.worker_cpus == 0 and not out.train.use_gpu and out.ref.workers == 0
    assert (out.sync.transport, out.sync.backend) == ("broadcast", "gloo")
    kept = command._settings(load_config(None, ["tracking.run_name=mine"]), Weights(tmp_path, False, "ckpt"))
    assert kept.tracking.run_name == "mine" and kept.model.path == "builtin:tiny"
    assert kept.data.val == "builtin:arith"  # no eval.data: the validation split


def test_cli_flags_become_eval_keys():
    args = _parser().parse_args(["eval", "--checkpoint", "/r", "--data", "/d.jsonl", "eval.n=2"])
    assert (args.checkpoint, args.data, args.overrides, args.config) == ("/r", "/d.jsonl", ["eval.n=2"], None)


def test_a_generation_row_holds_prompt_response_reward_source_and_index():
    s = Sample(token_ids=[5, 1], logprobs=[-0.1, -0.2], versions=[-1, -1], finish_reason="stop", text="7")
    s.reward, s.reward_extras = 1.0, {"format": 1.0}
    g = Group(uid="u1", prompt_ids=[3], answer="7", samples=[s], prompt_text="max:17=", data_source="arith")
    assert command.sample_row(g, 0) == {
        "uid": "u1",
        "data_source": "arith",
        "sample": 0,
        "prompt": "max:17=",
        "answer": "7",
        "response": "7",
        "reward": 1.0,
        "reward_error": None,
        "reward_extras": {"format": 1.0},
        "finish_reason": "stop",
        "response_tokens": 2,
    }


def test_validation_logs_per_source_scores_where_they_say_more_than_the_reward():
    one = score([PromptRewards("arith", [1.0]), PromptRewards("arith", [0.0])], [1], 1.0)
    assert per_source(one) == {}  # one sample, one source: val/reward says it all
    four = score([PromptRewards("arith", [1.0, 0.0, 0.0, 0.0])], [1, 4], 1.0)
    assert per_source(four) == {
        "val/arith/mean_at_4": 0.25,
        "val/arith/pass_at_1": 0.25,
        "val/arith/pass_at_4": 1.0,
        "val/all/mean_at_4": 0.25,
        "val/all/pass_at_1": 0.25,
        "val/all/pass_at_4": 1.0,
    }
    two = score([PromptRewards("a", [1.0]), PromptRewards("b", [0.0])], [1], 1.0)
    assert per_source(two)["val/a/mean_at_1"] == 1.0 and per_source(two)["val/b/pass_at_1"] == 0.0


def test_a_plain_hf_folder_without_config_is_held_to_real_work_settings(tmp_path):
    """`eval --checkpoint <an HF folder no Relay run wrote>` with the embedded default's toy lengths, dtype and
    CPUs is refused in one line naming the presets; with `--config` it takes that preset's settings."""
    hf = tmp_path / "my-model"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama"}')
    (hf / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError) as e:
        command.load(None, [f"eval.checkpoint={hf}"])
    msg = str(e.value)
    assert "\n" not in msg and f"model.path='{hf}'" in msg and "`--config gsm8k`" in msg, msg
    cfg = command.load("laptop", [f"eval.checkpoint={hf}"])
    assert cfg.rollout.max_tokens == 160 and cfg.data.max_prompt_tokens == 192
