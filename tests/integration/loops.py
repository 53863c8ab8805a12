"""Train-worker loops used by integration tests (importable by Ray workers through PYTHONPATH)."""

from __future__ import annotations

import json
from typing import Any


def logprob_loop(config: dict[str, Any]) -> None:
    """Push v0, train one step on a rollout batch, push v1; compare trainer and replica log-probs."""
    import ray
    import torch
    from omegaconf import OmegaConf
    from ray import serve

    from app.rollouter import rollouter_name
    from app.serve_rollout import DEPLOYMENT_NAME, NAMESPACE, app_name, hub_name
    from app.train_loop import Learner
    from app.train_worker import TrainerSync, _bcast

    cfg = OmegaConf.create(config["cfg"])
    # the GPU test (tests/gpu/test_loop_gpu.py) runs this on cuda with the IPC transport
    dev = torch.device("cuda", torch.cuda.current_device()) if config.get("cuda") else torch.device("cpu")
    learner = Learner(cfg, config["model_path"], dev)
    sync = TrainerSync(cfg, learner, ray.get_actor(hub_name(cfg.ray.name), namespace=NAMESPACE), dev)
    handle = serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=app_name(cfg.ray.name))
    sync.push(0)
    batch = None
    if learner.rank == 0:
        batch = ray.get(
            ray.get_actor(rollouter_name(cfg.ray.name), namespace=NAMESPACE).generate_batch.remote(4),
            timeout=120,
        )
    batch = _bcast(batch)
    g = batch.groups[0]
    prompt, completion = g.prompt_ids, g.samples[0].token_ids
    before = learner.logprobs_of(prompt, completion)
    vllm_before = (
        handle.completion_logprobs.remote(prompt, completion).result(timeout_s=60)
        if learner.rank == 0
        else None
    )
    learner.step(batch)
    push = sync.push(1)
    after = learner.logprobs_of(prompt, completion)
    if learner.rank == 0:
        vllm_after = handle.completion_logprobs.remote(prompt, completion).result(timeout_s=60)
        info = handle.info.remote().result(timeout_s=60)
        out = {
            "trainer_before": before,
            "trainer_after": after,
            "vllm_before": vllm_before,
            "vllm_after": vllm_after,
            "replica_version": info["version"],
            "push_bytes": push.nbytes,
            "push_buckets": push.buckets,
            "push": {"total_s": push.total_s, "transfer_s": push.transfer_s, "ack_s": push.ack_s},
            "transport": sync.transport_name,
            "token_versions": [s.versions for s in g.samples],
        }
        with open(config["out"], "w") as f:
            json.dump(out, f)
