"""bench/peers/trl_vs_relay.py's, trl_vs_relay_gpu.py's, trl_vs_relay_real.py's and trl_run.py's pure parts: Relay's config mapped to TRL's
settings, the metrics.jsonl figures, medians and ratios (no Ray, vLLM or TRL; TRL's own check of the settings
runs where it is installed)."""

import json
from pathlib import Path

import pytest

from bench.peers.trl_vs_relay import (
    cpu_at,
    medians,
    parse_result,
    ratios,
    read_metrics,
    relay_config,
    rounded,
    run_figures,
    trained_order,
    trl_settings,
    unmatched,
)


@pytest.fixture(scope="module")
def default_cfg():
    return relay_config([])


def test_the_default_job_maps_to_trl_settings_that_differ_from_trls_defaults(default_cfg):
    s = trl_settings(default_cfg, "/tmp/out")
    assert unmatched(default_cfg) == []
    assert s["learning_rate"] == 1e-3 and s["lr_scheduler_type"] == "constant" and s["warmup_steps"] == 0
    assert (s["adam_beta1"], s["adam_beta2"], s["weight_decay"], s["max_grad_norm"]) == (0.9, 0.99, 0.0, 1.0)
    assert s["optim"] == "adamw_torch" and s["adam_epsilon"] == 1e-8
    # 16 prompts x 8 samples: TRL counts completions, one generation and one optimizer step a batch
    assert s["num_generations"] == 8
    assert s["per_device_train_batch_size"] == s["generation_batch_size"] == 128
    assert s["gradient_accumulation_steps"] == 1 and s["num_iterations"] == 1
    assert (s["loss_type"], s["beta"], s["epsilon"], s["epsilon_high"]) == ("dapo", 0.0, 0.2, 0.28)
    assert s["scale_rewards"] == "group"
    assert (s["max_completion_length"], s["temperature"], s["top_p"], s["top_k"]) == (8, 1.0, 1.0, 0)
    assert s["bf16"] is False and s["gradient_checkpointing"] is False
    assert s["model_init_kwargs"] == {"dtype": "float32"}
    assert s["shuffle_dataset"] is False and s["use_vllm"] is False
    assert s["max_steps"] == 60 and s["seed"] == 0


def test_other_relay_settings_map_or_are_refused(default_cfg):
    cfg = json.loads(json.dumps(default_cfg))
    cfg["algorithm"].update(loss_agg="seq_mean", normalize_adv_std=False, clip_high=0.3)
    s = trl_settings(cfg, "/tmp/out")
    assert (s["loss_type"], s["scale_rewards"], s["epsilon_high"]) == ("grpo", "none", 0.3)
    cfg["algorithm"].update(mode="fully_async", kl_coef=0.1)
    cfg["train"]["warmup_steps"] = 3
    found = unmatched(cfg)
    assert [f.split("=")[0] for f in found] == ["algorithm.mode", "algorithm.kl_coef", "train.warmup_steps"]


def test_trl_accepts_every_setting(default_cfg, tmp_path):
    trl = pytest.importorskip("trl")
    args = trl.GRPOConfig(**trl_settings(default_cfg, str(tmp_path)))
    assert args.steps_per_generation == 1 and args.learning_rate == 1e-3 and args.bf16 is False


def _metrics(t0: float) -> str:
    lines = [{"step": 0, "time": t0 + 30, "val/reward": 0.4, "timing/val_s": 2.0}]
    for step in range(1, 11):
        lines.append({"step": step, "time": t0 + 30 + 3 * step, "reward/mean": 0.5, "loss/policy": 0.1})
        if step % 5 == 0:
            lines.append(
                {"step": step, "time": t0 + 31 + 3 * step, "val/reward": 0.5 + step / 20, "timing/val_s": 1.0}
            )
    return "\n".join(map(json.dumps, lines)) + "\nnot json\n" + json.dumps({"no": "step"}) + "\n"


def test_figures_from_metrics_jsonl_and_the_result_line():
    t0 = 1_000.0
    metrics = read_metrics(_metrics(t0))
    assert len(metrics) == 13  # the broken line and the line without step/time are skipped
    result = parse_result(
        'log line\nRESULT {"ok": true, "steps": 10, "loop_s": 31.0, "trained_tokens": 3000}\n'
    )
    f = run_figures(metrics, result, t0, threshold=0.9)
    assert f["startup_s"] == 33.0  # the end of step 1
    assert f["time_to_threshold_s"] == 61.0  # step 10's validation, 1.0, is the first >= 0.9
    assert f["val_in_loop_s"] == 1.0  # step 5's: step 0's runs before the loop, step 10's after it
    assert f["tokens_per_s"] == 100.0 and f["tokens_per_s_raw"] == pytest.approx(3000 / 31)
    assert (f["val_first"], f["val_last"], f["val_max"]) == (0.4, 1.0, 1.0)
    assert f["_loop_window"] == (t0 + 30, t0 + 60)
    assert run_figures(metrics, result, t0, threshold=1.5)["time_to_threshold_s"] is None


def test_medians_and_ratios():
    runs = [
        {"tokens_per_s": 100.0, "wall_s": 60.0, "time_to_threshold_s": None, "x": True, "curve": [1]},
        {"tokens_per_s": 300.0, "wall_s": 80.0, "time_to_threshold_s": 50.0, "x": False, "curve": [2]},
        {"tokens_per_s": 200.0, "wall_s": 70.0, "time_to_threshold_s": 40.0, "x": True, "curve": [3]},
    ]
    m = medians(runs)
    assert (m["tokens_per_s"], m["wall_s"], m["time_to_threshold_s"]) == (200.0, 70.0, 45.0)
    assert m["x"] is None and "curve" not in m and m["threshold_reached"] == "2/3"
    r = ratios(
        {"tokens_per_s": 400.0, "wall_s": 35.0, "time_to_threshold_s": None},
        {"tokens_per_s": 200.0, "wall_s": 70.0, "time_to_threshold_s": 45.0, "peak_rss_mb": 0.0},
    )
    assert (r["tokens_per_s"], r["wall_s"], r["time_to_threshold_s"]) == (2.0, 0.5, None)
    assert r["peak_rss_mb"] is None  # TRL's 0: no ratio
    assert rounded({"a": 1.23456, "b": 12345.67, "c": 3, "d": None}) == {
        "a": 1.235,
        "b": 12345.7,
        "c": 3,
        "d": None,
    }


def test_trained_order_is_relays_step_by_step(tmp_path):
    path = tmp_path / "trained_groups.jsonl"
    rows = [
        {"uid": "c", "step": 2},
        {"uid": "a", "step": 1},
        {"uid": "b", "step": 1},
        {"uid": "d", "step": 2},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert trained_order(path, 2, 2) == ["a", "b", "c", "d"]
    assert trained_order(path, 1, 2) == ["a", "b"]
    with pytest.raises(RuntimeError, match="expected 6"):
        trained_order(path, 2, 3)


def test_cpu_at_interpolates_the_sampled_series():
    series = [(10.0, 1.0), (11.0, 3.0), (12.0, 3.0)]
    assert [cpu_at(series, t) for t in (5.0, 10.5, 11.5, 20.0)] == [1.0, 2.0, 3.0, 3.0]
    assert cpu_at([], 1.0) == 0.0


# ------------------------------------------------------------------ bench/peers/trl_vs_relay_gpu.py (one GPU)


@pytest.fixture(scope="module")
def gpu_cfg():
    """The GPU bench's resolved config: configs/gpu1.yaml on 64 prompts, 16 x 8 a step, fixed 1,024 tokens."""
    from omegaconf import OmegaConf

    from app.preflight import load_config
    from bench.peers.trl_vs_relay_gpu import OVERRIDES

    overrides = [
        "train.batch_groups=16",
        "rollout.n=8",
        "rollout.max_tokens=1024",
        "rollout.max_model_len=1088",
        "rollout.ignore_eos=true",
        "algorithm.mode=sync",
        *OVERRIDES,
    ]
    return OmegaConf.to_container(load_config("gpu1", overrides), resolve=True)


def test_the_gpu_job_maps_to_trl_colocate_with_relays_batch_and_lengths(gpu_cfg):
    from bench.peers.trl_vs_relay_gpu import gpu_settings

    assert unmatched(gpu_cfg) == []
    s = {**trl_settings(gpu_cfg, "/tmp/out"), **gpu_settings(gpu_cfg, 8)}
    assert s["use_vllm"] is True and s["vllm_mode"] == "colocate" and s["use_cpu"] is False
    assert s["vllm_gpu_memory_utilization"] == 0.4 and s["vllm_max_model_length"] == 1088
    assert s["generation_kwargs"] == {"ignore_eos": True} and s["max_completion_length"] == 1024
    # 128 completions a step: one generation, 16 micro-batches of 8, one optimizer step
    assert s["generation_batch_size"] == 128 and s["num_generations"] == 8
    assert (s["per_device_train_batch_size"], s["gradient_accumulation_steps"]) == (8, 16)
    assert (
        s["bf16"] is True and s["model_init_kwargs"] == {"dtype": "float32"} and s["learning_rate"] == 1e-6
    )  # float32 parameters under bf16 autocast, as Relay's FSDP2 mixed precision
    with pytest.raises(ValueError, match="--micro 12 must divide the 128 completions"):
        gpu_settings(gpu_cfg, 12)


def test_trl_step_points_and_the_two_ratios(tmp_path):
    from bench.peers.trl_vs_relay_gpu import steady_tokens_per_s, step_points, with_ratios

    metrics = tmp_path / "m.jsonl"
    lines = [
        {"step": 0, "time": 100.0, "val/reward": 0.0},
        {"step": 1, "time": 120.0, "tokens": 1000, "reward/mean": 0.0},
        {"step": 2, "time": 130.0, "tokens": 1000, "reward/mean": 0.0},
        {"step": 3, "time": 140.0, "tokens": 1000, "reward/mean": 0.0},
        {"step": 4, "time": 145.0, "tokens": 1000, "reward/mean": 0.0},
    ]
    metrics.write_text("".join(json.dumps(x) + "\n" for x in lines))
    points = step_points(metrics)
    assert points == [(1, 120.0, 1000), (2, 130.0, 1000), (3, 140.0, 1000), (4, 145.0, 1000)]
    assert steady_tokens_per_s(points) == pytest.approx(2000 / 20)  # steps 2-3, from step 1's end to 3's
    relay = {
        "sync": {"tokens_per_s": 300.0, "steady_tokens_per_s": 400.0},
        "one_step_off": {"tokens_per_s": 250.0, "steady_tokens_per_s": 500.0},
    }
    summary = {"relay": relay, "trl": {"tokens_per_s": 200.0, "steady_tokens_per_s": 250.0}}
    out = with_ratios(summary)
    assert out["ratio"] == {"mode": "sync", "value": 1.5}
    assert out["steady_ratio"] == {"mode": "one_step_off", "value": 2.0}
    assert with_ratios({"relay": relay}) == {"relay": relay}  # TRL has not run yet
    nan = {"trl": {"tokens_per_s": 200.0, "steady_tokens_per_s": float("nan")}, "relay": relay}
    assert "steady_ratio" not in with_ratios(nan) and with_ratios(nan)["ratio"]["value"] == 1.5


def test_a_relay_run_with_overrides_is_its_own_entry_beside_the_plain_mode():
    from bench.peers.trl_vs_relay_gpu import entry_name, with_ratios

    assert entry_name("sync", []) == "sync"
    key = entry_name("sync", ["rollout.behaviour_logprobs=trainer", "rollout.max_num_seqs=512"])
    assert key == "sync+rollout.behaviour_logprobs=trainer,rollout.max_num_seqs=512"
    nan = float("nan")  # too few steps for a steady figure: the whole-loop ratio alone
    relay = {
        "sync": {"tokens_per_s": 300.0, "steady_tokens_per_s": nan},
        key: {"tokens_per_s": 450.0, "steady_tokens_per_s": nan},
    }
    out = with_ratios({"relay": relay, "trl": {"tokens_per_s": 200.0, "steady_tokens_per_s": nan}})
    assert out["ratio"] == {"mode": key, "value": 2.25}  # the ratio names the settings that won


def test_the_real_model_job_maps_to_trl_with_its_warm_up_and_natural_lengths():
    from bench.peers.trl_vs_relay_real import PRESET, relay_overrides, resolved, trl_grpo

    cfg = resolved(relay_overrides(Path("/tmp/w"), 60, []))
    assert PRESET == "gsm8k" and cfg["algorithm"]["mode"] == "fully_async"  # the recipes differ on purpose
    g = trl_grpo(cfg, "/tmp/out", 32, 0.5)
    assert g["lr_scheduler_type"] == "constant_with_warmup" and g["warmup_steps"] == 5
    assert g["learning_rate"] == 1e-5 and g["max_completion_length"] == 512 and g["max_steps"] == 60
    assert "generation_kwargs" not in g  # responses end at EOS
    assert (
        g["generation_batch_size"],
        g["per_device_train_batch_size"],
        g["gradient_accumulation_steps"],
    ) == (
        256,
        32,
        8,
    )
    assert g["vllm_gpu_memory_utilization"] == 0.5 and g["vllm_max_model_length"] == 1024
    assert g["bf16"] is True and g["model_init_kwargs"] == {"dtype": "float32"}
    cfg["algorithm"]["kl_coef"] = 0.1  # a setting outside the recipes' differences is still refused
    with pytest.raises(SystemExit, match="algorithm.kl_coef"):
        trl_grpo(cfg, "/tmp/out", 32, 0.5)


def test_time_to_threshold_without_the_validations_before_it():
    from bench.peers.trl_vs_relay_real import threshold_train_s

    metrics = [
        {"step": 0, "time": 110.0, "val/reward": 0.1, "timing/val_s": 10.0},
        {"step": 5, "time": 150.0, "reward/mean": 0.2},
        {"step": 10, "time": 200.0, "val/reward": 0.3, "timing/val_s": 5.0},
        {"step": 20, "time": 300.0, "val/reward": 0.45, "timing/val_s": 6.0},
        {"step": 30, "time": 400.0, "val/reward": 0.5, "timing/val_s": 6.0},
    ]
    assert threshold_train_s(metrics, 100.0, 0.4) == pytest.approx(300 - 100 - (10 + 5 + 6))
    assert threshold_train_s(metrics, 100.0, 0.9) is None


def test_trl_runs_reward_scores_chat_completions_with_relays_reward_and_sub_scores():
    from bench.peers.trl_run import RewardCounter, response_text, scored

    assert response_text("plain") == "plain"
    assert response_text([{"role": "assistant", "content": "#### 7"}]) == "#### 7"
    counter = RewardCounter("gsm8k_shaped")
    assert counter.__name__ == "gsm8k_shaped"
    completions = [
        [{"role": "assistant", "content": "3 + 4 = 7 #### 7"}],  # strict
        [{"role": "assistant", "content": "so 7"}],  # the last number
        [{"role": "assistant", "content": "#### 8"}],  # the format alone
    ]
    scores = counter([None] * 3, completions, [[1, 2], [3], [4, 5, 6]], ["#### 7"] * 3)
    assert scores == [1.0, 0.8, 0.1]
    assert counter.take() == (6, pytest.approx(1.9 / 3)) and counter.take() == (0, 0.0)
    assert scored(RewardCounter().fn, "4", "4") == {"score": 1.0}  # exact_match returns a float
    assert scored(counter.fn, "#### 7", "7") == {
        "score": 1.0,
        "strict": 1.0,
        "flexible": 1.0,
        "formatted": 1.0,
    }


def test_the_real_model_bench_takes_built_in_tasks_only():
    from bench.peers.trl_vs_relay_real import relay_overrides, resolved, task

    cfg = resolved(relay_overrides(Path("/tmp/w"), 60, ["data.train=/data/train.jsonl"]))
    with pytest.raises(SystemExit, match="data.train='/data/train.jsonl': this bench takes one of"):
        task(cfg)
