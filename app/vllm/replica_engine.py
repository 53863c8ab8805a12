"""A rollout replica's engine, from the run's config: its `create_engine` arguments, its environment, and the
samples of one generation request.

Serve's replicas (app/serve_rollout.py) and the in-process engine of `python -m app eval`
(app/evaluation/local.py) build and call their engines through these functions, so both run one vLLM
configuration and sample one way: the same seeds give the same samples.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from app.vllm import engine as vla

if TYPE_CHECKING:
    from app.records import GenerateRequest
    from app.vllm.adapters import Adapter


def engine_args(cfg: Any) -> dict[str, Any]:
    """`create_engine`'s keyword arguments (all but the model and `partial`) for a replica of the run `cfg`:
    `model.dtype`, `rollout.*` (a GPU engine where `rollout.replica_gpus` > 0) and the run's `seed`."""
    from app.infra.resources import memory_share

    r = cfg.rollout
    return dict(
        dtype=cfg.model.dtype,
        max_model_len=r.max_model_len,
        max_num_seqs=r.max_num_seqs,
        gpu_memory_utilization=memory_share(r),
        seed=cfg.seed,
        use_gpu=r.replica_gpus > 0,
        cuda_graphs=r.cuda_graphs,
        lora_rank=cfg.model.lora.rank,
        tensor_parallel_size=r.tensor_parallel_size,
    )


def engine_env(cfg: Any) -> dict[str, str]:
    """Environment variables of the process that builds a replica's engine, set before vLLM is imported: a CPU
    engine's (`cpu_env`), hidden from every GPU; none for a GPU engine."""
    from app.infra.resources import role_env

    r = cfg.rollout
    return {} if r.replica_gpus > 0 else {**vla.cpu_env(r.kv_cache_gib), **role_env(0)}


async def generate_request(
    engine: Any, req: GenerateRequest, version: int, adapter: Adapter | None = None
) -> list[dict[str, Any]]:
    """The samples of `req` (unscored; `vla.generate`'s dicts), tagged `version` (with LoRA: generated with, and
    tagged with, `adapter`). A seeded request for `n` samples runs as `n` engine requests seeded `seed`,
    `seed + 1`, ...: the samples a group's per-sample requests would give (`rollout.group_requests`)."""
    if req.n > 1 and req.seed is not None:
        parts = await asyncio.gather(
            *[_engine_generate(engine, req, 1, req.seed + i, version, adapter) for i in range(req.n)]
        )
        return [s for part in parts for s in part]
    return await _engine_generate(engine, req, req.n, req.seed, version, adapter)


async def _engine_generate(
    engine: Any, req: GenerateRequest, n: int, seed: int | None, version: int, adapter: Adapter | None
) -> list[dict[str, Any]]:
    return await vla.generate(
        engine,
        list(req.prompt_ids),
        n=n,
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stop=list(req.stop),
        version=version,
        seed=seed,
        ignore_eos=req.ignore_eos,
        logprobs=req.logprobs,
        adapter=adapter,
    )
