"""The one place that talks to vLLM. Detects features, not versions.

Everything else in Relay calls these functions; a vLLM upgrade that moves an API is fixed here.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

log = logging.getLogger(__name__)

WORKER_EXTENSION = "app.vllm_worker.RelayWorkerExtension"


def cpu_env(kv_cache_gib: float) -> dict[str, str]:
    """Environment a CPU replica needs before vLLM is imported (see stack-facts: thread binding, KV space)."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, int(round(kv_cache_gib)))),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "TOKENIZERS_PARALLELISM": "false",
    }


def create_engine(
    model_path: str,
    *,
    dtype: str,
    max_model_len: int,
    max_num_seqs: int,
    gpu_memory_utilization: float,
    seed: int = 0,
    use_gpu: bool = False,
):
    """An AsyncLLM with our worker extension, behaviour log-probs after temperature, eager mode."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    kwargs: dict[str, Any] = dict(
        model=model_path,
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        enforce_eager=True,
        seed=seed,
        worker_extension_cls=WORKER_EXTENSION,
        enable_prefix_caching=False,
    )
    if use_gpu:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    fields = getattr(AsyncEngineArgs, "__dataclass_fields__", {})
    if "logprobs_mode" in fields:
        kwargs["logprobs_mode"] = "processed_logprobs"
    return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))


def _seeded_sampling_ok() -> bool:
    """Per-request seeds crash vLLM 0.32's CPU worker once a seeded request is preempted or its sampled token
    discarded ("CPU Generator does not use offset" kills the engine core). On CPU the engine seed alone is used."""
    import torch

    return torch.cuda.is_available()


def _spans_to_versions(spans: Any, n_tokens: int, fallback: int) -> list[int]:
    versions = [fallback] * n_tokens
    for sp in spans or []:
        raw = str(getattr(sp, "version", fallback))
        v = (
            int(raw) if raw.lstrip("-").isdigit() else fallback
        )  # an engine never given a version says "default"
        for i in range(int(sp.start), min(int(sp.end), n_tokens)):
            versions[i] = v
    return versions


async def generate(
    engine,
    prompt_ids: list[int],
    *,
    n: int,
    max_tokens: int,
    temperature: float,
    top_p: float,
    version: int,
    seed: int | None = None,
    ignore_eos: bool = False,
) -> list[dict[str, Any]]:
    """Token-in/token-out sampling. Each sample: token_ids, logprobs (of the sampled tokens), finish_reason,
    versions (one per token: native per-token version spans where vLLM has them, else the replica's)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    if seed is not None and not _seeded_sampling_ok():
        seed = None
    params = SamplingParams(
        n=n,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        logprobs=0,
        seed=seed,
        output_kind=RequestOutputKind.FINAL_ONLY,
        detokenize=False,
        ignore_eos=ignore_eos,
    )
    final = None
    async for out in engine.generate({"prompt_token_ids": list(prompt_ids)}, params, uuid.uuid4().hex):
        final = out
    if final is None:
        raise RuntimeError("vLLM returned no output for a generation request")
    samples = []
    for comp in final.outputs:
        ids = list(comp.token_ids)
        lps = (
            [float(comp.logprobs[i][t].logprob) for i, t in enumerate(ids)]
            if comp.logprobs
            else [0.0] * len(ids)
        )
        samples.append(
            {
                "token_ids": ids,
                "logprobs": lps,
                "finish_reason": comp.finish_reason or "unknown",
                "versions": _spans_to_versions(getattr(comp, "weight_versions", None), len(ids), version),
            }
        )
    return samples


async def completion_logprobs(engine, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """Log-probs the current weights assign to a fixed completion (raw model, temperature 1)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    ids = list(prompt_ids) + list(completion_ids)
    params = SamplingParams(
        max_tokens=1,
        prompt_logprobs=0,
        temperature=1.0,
        output_kind=RequestOutputKind.FINAL_ONLY,
        detokenize=False,
    )
    final = None
    async for out in engine.generate({"prompt_token_ids": ids}, params, uuid.uuid4().hex):
        final = out
    plp = final.prompt_logprobs
    start = len(prompt_ids)
    return [float(plp[i][ids[i]].logprob) for i in range(start, len(ids))]


async def set_version(engine, version: int) -> None:
    if hasattr(engine, "update_weight_version"):
        await engine.update_weight_version(str(version))


async def rpc(engine, method: str, timeout: float | None = None, **kwargs: Any) -> list[Any]:
    """collective_rpc to every worker of this engine (our worker extension's methods)."""
    return await engine.collective_rpc(method, timeout=timeout, kwargs=kwargs)


PAUSE_MODES = {"keep": "keep", "resubmit": "abort", "off": "wait"}  # rollout.partial -> vLLM pause mode


async def pause(engine, partial: str = "keep") -> None:
    """Pause generation for a weight load. `keep`: in-flight requests freeze and continue after resume with
    their KV cache recomputed; `resubmit`: they are aborted (the caller resubmits them); `off`: they finish
    under the old weights first."""
    if hasattr(engine, "pause_generation"):
        await engine.pause_generation(mode=PAUSE_MODES[partial], clear_cache=True)


async def resume(engine) -> None:
    if hasattr(engine, "resume_generation"):
        await engine.resume_generation()


def shutdown(engine) -> None:
    if engine is not None and hasattr(engine, "shutdown"):
        engine.shutdown()
