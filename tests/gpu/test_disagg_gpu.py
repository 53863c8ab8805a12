"""Disaggregated on two GPUs, on the real components: a Serve vLLM replica on GPU1, a Ray Train FSDP2 worker on
GPU0, weights pushed over NCCL by the trainer's `TrainerSync` through the run's `WeightHub` (issue 27).

One run of `tests/integration/loops.py:disagg_loop` (module fixture) does, in order: the first push and a
bit-exact check of what the engine holds; a training step, a push, and trainer vs vLLM log-probs; pushes back
to back (their phases); a push while long generations are in flight (keep mode); and a push during which the
replica's EngineCore is frozen and then SIGKILLed. The tests below assert on its report.

    # one pytest process per parametrisation: a second Ray session in one process stalled its trainer's start
    for p in paused staged; do PYTHONPATH=/tmp/site:$PWD python3 -m pytest -q -s tests/gpu/test_disagg_gpu.py -k $p; done

Needs 2 CUDA GPUs, vLLM with a GPU build and Ray (the lent machine: ../shared/tools/gpu-overlay/README.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("the 2-GPU tier needs 2 CUDA GPUs", allow_module_level=True)
pytest.importorskip("vllm")
pytest.importorskip("ray")

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]
LP_MAX, LP_MEAN = 0.15, 0.03  # bf16 trainer (fp32 master, bf16 compute) vs bf16 vLLM, nats per token
SYNC_TIMEOUT_S = 20.0


@pytest.fixture(scope="module", params=["paused", "staged"])
def report(request, tmp_path_factory) -> dict:
    """One run per receive path: `paused` (the default) and `sync.staged_receive` (the workers receive while
    the engine generates; the staged run skips the engine kill, which the paused run covers)."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from app.config import load_config, to_container
    from app.driver import resolve_inputs, start_roles, teardown
    from app.names import app_name
    from app.rollout.start_watch import RolloutStartWatch
    from tests.integration.loops import disagg_loop

    staged = request.param == "staged"
    tmp = tmp_path_factory.mktemp(f"disagg-{request.param}")
    cfg = load_config(
        "gpu2",
        [
            "ray.name=g2",
            f"sync.staged_receive={str(staged).lower()}",
            f"model.cache_dir={tmp / 'cache'}",
            f"sync.timeout_s={SYNC_TIMEOUT_S}",
            "train.lr=0.01",
            "rollout.join_timeout_s=300",
        ],
    )
    inputs = resolve_inputs(cfg)
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO)), "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "1"}
    ray.init(address="local", num_cpus=16, num_gpus=2, runtime_env={"env_vars": env}, log_to_driver=True)
    out = tmp / "disagg.json"
    try:
        cfg, _hub, _control, _rollouter = start_roles(cfg, inputs, RolloutStartWatch(app_name("g2")))
        TorchTrainer(
            disagg_loop,
            train_loop_config={
                "cfg": to_container(cfg),
                "model_path": inputs.model_path,
                "out": str(out),
                "kill": not staged,
            },
            scaling_config=ScalingConfig(
                num_workers=1, use_gpu=True, resources_per_worker={"CPU": 1, "GPU": cfg.train.worker_gpus}
            ),
            run_config=RunConfig(name="disagg", storage_path=str(tmp / "train")),
        ).fit()
    finally:
        teardown(cfg, started=False)
        ray.shutdown()
    r = json.loads(out.read_text())
    r["staged"] = staged
    print(
        "GPU2_REPORT",
        request.param,
        json.dumps({k: v for k, v in r.items() if not k.startswith(("trainer_", "vllm_"))}),
    )
    return r


def test_nccl_broadcast_is_the_transport(report):
    assert report["transport"] == "broadcast" and report["backend"] == "nccl", report


def test_loads_are_bit_exact(report):
    for key in ("exact_v0", "exact_v1"):
        ex = report[key]
        assert ex["why"] is None and ex["compared"] > 0, ex
        assert not ex["unequal"] and not ex["missing"], ex  # the engine holds exactly the trainer's tensors


def test_logprobs_agree_after_a_push(report):
    d = {}
    for when in ("before", "after"):
        diff = [
            abs(a - b)
            for a, b in zip(report[f"trainer_{when}"], report[f"vllm_{when}"]["logprobs"], strict=True)
        ]
        d[when] = (max(diff), sum(diff) / len(diff))
        assert d[when][0] <= LP_MAX and d[when][1] <= LP_MEAN, d
    moved = max(abs(a - b) for a, b in zip(report["trainer_before"], report["trainer_after"], strict=True))
    assert moved > LP_MAX, moved  # the step moved the policy: the push really landed
    assert report["vllm_after"]["version"] == 1


def test_every_push_is_acknowledged_with_its_phases(report):
    pushes = report["pushes"]
    assert [p["version"] for p in pushes] == list(range(len(pushes)))
    for p in pushes:
        assert not p["failures"] and len(p["replicas"]) == 1, p
        ph = p["phases"]
        for k in (
            "replica_wake_s",
            "replica_pause_s",
            "replica_receive_s",
            "replica_load_s",
            "replica_resume_s",
            *(["replica_stage_s"] if report["staged"] else []),
        ):
            assert k in ph, ph
    print("PUSHES", [p["summary"] for p in pushes])


def test_tokens_carry_versions_across_a_keep_mode_push(report):
    keep = report["keep"]
    v = keep["push"]["version"]
    spanning = [vs for vs in keep["versions"] if len(set(vs)) > 1]
    assert spanning, "no generation was in flight across the push"
    for vs in keep["versions"]:
        assert vs == sorted(vs) and set(vs) <= {v - 1, v}, vs  # old tokens first, then the new version's


def test_engine_killed_mid_push_fails_that_try_and_the_push_recovers(report):
    if report["staged"]:
        pytest.skip("the engine kill runs once, in the paused run")
    k = report["kill"]
    assert not k["alive_after"] and k["error"] is None, k
    fails = k["push"]["failures"]
    assert fails and k["victim"] in fails[0], k  # the failed try names the replica
    assert k["dropped"], k
    assert k["victim"] not in k["push"]["replicas"], k  # delivered to the replica Serve started instead
    after = report["after_kill"]
    assert not after["failures"], after
    ex = report["exact_after_kill"]
    assert not ex["unequal"] and not ex["missing"] and ex["compared"] > 0, ex
