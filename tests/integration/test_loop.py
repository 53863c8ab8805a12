"""The whole loop on a local Ray cluster: Serve vLLM replicas, a Ray Data prompt stream, FSDP2 TorchTrainer."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.integration.conftest import REPO, train_cmd


def test_generation_carries_versions_and_logprobs(rollout_stack):
    import ray

    batch = ray.get(rollout_stack["rollouter"].generate_batch.remote(3), timeout=120)
    assert len(batch.groups) == 3
    for g in batch.groups:
        assert len(g.samples) == rollout_stack["cfg"].rollout.n
        for s in g.samples:
            assert len(s.logprobs) == len(s.token_ids) == len(s.versions) > 0
            assert all(lp <= 0 for lp in s.logprobs)
            assert s.finish_reason in ("stop", "length")


def test_a_seeded_group_request_gives_the_samples_of_its_per_sample_requests(rollout_stack):
    """`rollout.group_requests`: the real replica runs a seeded request for n samples as n engine requests
    seeded seed, seed + 1, ...: the tokens of the group's per-sample requests."""
    from dataclasses import replace

    from app.records import GenerateRequest

    handle = rollout_stack["handle"]
    base = GenerateRequest(prompt_ids=[5, 6, 7, 8], max_tokens=12, temperature=1.0, ignore_eos=True, seed=41)
    group = handle.generate.remote(replace(base, n=3)).result(timeout_s=120)
    singles = [handle.generate.remote(replace(base, seed=41 + i)).result(timeout_s=120) for i in range(3)]
    got = [s.token_ids for s in group.samples]
    assert got == [r.samples[0].token_ids for r in singles]
    assert len(set(map(tuple, got))) > 1  # three seeds, not one sample three times
    assert all(len(s.versions) == len(s.token_ids) == 12 for s in group.samples)


def test_a_cpu_replica_runs_its_vllm_worker_inside_the_engine_core(rollout_stack):
    """A CPU replica has one vLLM process, its engine core, where the model runs (app/vllm/engine.py
    `cpu_env`): the pid the worker reports is the engine core's (with vLLM's "mp" executor it is another
    process, a child of the engine core)."""
    import psutil

    info = rollout_stack["handle"].info.remote().result(timeout_s=60)
    names = {}
    for child in psutil.Process(info["pid"]).children(recursive=True):
        try:
            names[child.pid] = " ".join([child.name(), *child.cmdline()])
        except psutil.NoSuchProcess:
            continue
    cores = [pid for pid, name in names.items() if "EngineCore" in name]
    assert len(cores) == 1 and info["engine_pids"] == cores, (info["engine_pids"], names)
    assert info["engine_log_stats"] is False  # vLLM's statistics, which nothing reads, are off


def test_trainer_and_vllm_logprobs_match_after_step_and_push(rollout_stack, tmp_path):
    from omegaconf import OmegaConf
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from app.config import to_container
    from tests.integration.loops import logprob_loop

    cfg = rollout_stack["cfg"]
    out = tmp_path / "lp.json"
    trainer = TorchTrainer(
        logprob_loop,
        train_loop_config={
            "cfg": to_container(OmegaConf.merge(cfg, {"train": {"lr": 0.01}})),
            "model_path": rollout_stack["inputs"].model_path,
            "out": str(out),
        },
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="lp", storage_path=str(tmp_path / "train")),
    )
    trainer.fit()
    r = json.loads(out.read_text())
    diff_before = max(abs(a - b) for a, b in zip(r["trainer_before"], r["vllm_before"]["logprobs"]))
    diff_after = max(abs(a - b) for a, b in zip(r["trainer_after"], r["vllm_after"]["logprobs"]))
    moved = max(abs(a - b) for a, b in zip(r["trainer_before"], r["trainer_after"]))
    assert diff_before <= 1e-3, diff_before
    assert diff_after <= 1e-3, diff_after  # the replica serves exactly the trained weights
    assert moved > 1e-3  # ... which did change
    assert r["replica_version"] == 1 and r["vllm_after"]["version"] == 1
    assert all(v == 0 for vs in r["token_versions"] for v in vs)  # sampled by the pushed v0
    # the answers came the short way: each vLLM worker's into the weight group's store, with the checksums
    # it received, before the replica's reply; then each replica's own, with its phases, through the hub
    assert r["acked_via"] == "workers" and r["acks_at_return"], r
    assert all(
        a["checksums"] == r["push_checksums"] and a["by"] == "workers" and a["worker_s"] > 0
        for a in r["acks_at_return"].values()
    ), r
    assert all(a["checksums"] == r["push_checksums"] and a["held_s"] > 0 for a in r["acks"].values())


REQUIRED = [
    "reward/mean",
    "reward/std",
    "response/length_mean",
    "loss/policy",
    "loss/kl",
    "actor/entropy",
    "actor/clip_frac",
    "actor/grad_norm",
    "staleness/mean",
    "staleness/max",
    "perf/gen_tokens_per_s",
    "perf/train_tokens_per_s",
    "sync/time_s",
    "sync/bytes",
    "timing/generate_s",
    "timing/train_s",
    "val/reward",
]


def check_tracked_run(res: dict, initial_model: Path, mode: str) -> None:
    """What every finished run leaves in MLflow and on disk: the mode's params, the per-step metrics, the
    artifacts, and a final checkpoint (an HF folder) whose weights differ from the initial model's.
    (The sync mode's run is checked by tests/integration/test_job_submit.py.)"""
    import torch
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    client = MlflowClient(res["tracking_uri"])
    run = client.get_run(res["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["algorithm.mode"] == mode
    for key in REQUIRED:
        assert client.get_metric_history(res["run_id"], key), f"metric {key} missing"
    artifacts = {a.path for a in client.list_artifacts(res["run_id"])}
    assert {"config.yaml", "final", "samples", "reward_curve.png", "rollouts.jsonl"} <= artifacts
    assert client.get_metric_history(res["run_id"], "system/cpu_utilization_percentage")
    final = Path(res["final_checkpoint"])
    # artifacts under the run folder's root, beside the store (not the working directory's ./mlruns)
    assert Path(run.info.artifact_uri.removeprefix("file://")).is_relative_to(final.parent.parent), run.info
    rollouts = [json.loads(x) for x in (final.parent / "rollouts.jsonl").read_text().splitlines()]
    assert rollouts and {r["step"] for r in rollouts} <= set(range(1, res["steps"] + 1))
    assert all(r["prompt"] and isinstance(r["reward"], float) and r["versions"] for r in rollouts)
    metrics = [json.loads(x) for x in (final.parent / "metrics.jsonl").read_text().splitlines()]
    assert set(range(1, res["steps"] + 1)) <= {m["step"] for m in metrics if "reward/mean" in m}
    assert any("val/reward" in m for m in metrics) and any("run/wall_s" in m for m in metrics)
    assert (final / "config.json").exists() and (final / "tokenizer.json").exists()
    w0, w1 = load_file(initial_model / "model.safetensors"), load_file(final / "model.safetensors")
    assert set(w0) == set(w1)
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)  # the weights changed


def test_one_step_off_code_task_end_to_end(ray_cluster, cache_dir, tmp_path):
    """one_step_off with every side role, on builtin:code with the tiny ASCII model: programs run against
    each problem's tests in the sandbox, on a CPU reward worker, once each batch is generated
    (`reward.overlap=false`, the baseline of bench/reward_overlap.py: every other run here scores each
    trajectory as it finishes); reference log-probs for the KL penalty come from a reference worker, not the
    trainer. Reward, sub-scores (tests passed, failure kinds), staleness (exactly one version after the first
    batch) and the scoring time of each batch reach MLflow."""
    from mlflow.tracking import MlflowClient

    cmd = train_cmd(
        ray_cluster,
        cache_dir,
        tmp_path,
        "e2e-one-step-off",
        "algorithm.mode=one_step_off",
        "model.path=builtin:tiny-code",
        "data.train=builtin:code",
        "data.val=builtin:code",
        "data.max_prompt_tokens=400",
        "data.val_size=4",
        "rollout.max_tokens=64",
        "rollout.max_model_len=512",
        "train.batch_groups=4",
        "reward.workers=1",
        "reward.overlap=false",
        "ref.workers=1",
        "algorithm.kl_coef=0.05",
        "train.workers=1",  # one trainer rank: this test is not about the trainer (2-rank runs: async keep, resume, LoRA resume)
    )
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout[-2000:]  # RESULT on its own line, once
    res = json.loads(lines[0][len("RESULT ") :])
    assert res["ok"] is True
    assert set(res) >= {
        "run_id",
        "tracking_uri",
        "steps",
        "val_reward_first",
        "val_reward_last",
        "weight_version",
        "wall_s",
    }
    assert res["steps"] == 4 and res["weight_version"] == 4
    assert 0 <= res["val_reward_first"] <= 1 and 0 <= res["val_reward_last"] <= 1
    check_tracked_run(res, next(Path(cache_dir).glob("builtin-code-*/model")), "one_step_off")

    client = MlflowClient(res["tracking_uri"])
    # the first batch is on-policy, every later one exactly one version old
    stale = [m.value for m in client.get_metric_history(res["run_id"], "staleness/max")]
    assert sorted(stale) == [0, 1, 1, 1]
    mean = [m.value for m in client.get_metric_history(res["run_id"], "staleness/mean")]
    assert sorted(mean) == [0, 1, 1, 1]
    kl = [m.value for m in client.get_metric_history(res["run_id"], "loss/kl")]
    run = client.get_run(res["run_id"])
    assert max(kl) > 0 and run.data.params["ref.workers"] == "1"  # reference log-probs: the policy moved away
    keys = set(run.data.metrics)
    assert {"reward/mean", "reward/sub/passed", "reward/sub/total"} <= keys, keys
    assert client.get_metric_history(res["run_id"], "reward/sub/total")[-1].value == 3  # three hidden tests
    kinds = {"reward/sub/error", "reward/sub/wrong_answer", "reward/sub/timeout", "reward/sub/output_limit"}
    assert keys & kinds, keys  # how the programs failed, by kind
    scoring = [m.value for m in client.get_metric_history(res["run_id"], "timing/reward_after_s")]
    assert len(scoring) == 4 and all(v > 0 for v in scoring), scoring  # each batch scored after generation
