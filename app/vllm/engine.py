"""The engine adapter: the one place that talks to vLLM's engine. Detects features, not versions.

Everything else in Relay calls these functions; a vLLM upgrade that moves an API is fixed here. An engine
that lacks a capability the run needs does not start (`check_capabilities`): a missing `pause_generation`
would otherwise load weights in the middle of generation, silently mixing two policies in one sample.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import time
import uuid
from typing import TYPE_CHECKING, Any

from app.rollout.partial import PartialPolicy, partial_policy
from app.vllm.start_lock import engine_start_lock

if TYPE_CHECKING:
    from app.vllm.adapters import Adapter

log = logging.getLogger(__name__)

WORKER_EXTENSION = "app.vllm.worker.RelayWorkerExtension"  # a dotted path: vLLM imports it in each worker


class EngineCapabilityError(RuntimeError):
    """The vLLM engine lacks something the configuration needs; the message names it and the fix."""


class PauseFailed(RuntimeError):
    """`paused_call`'s pause failed before anything went to the workers: the engine holds its weights."""


def _capabilities(engine_cls: type) -> dict[str, bool]:
    pause = getattr(engine_cls, "pause_generation", None)
    try:
        pause_modes = pause is not None and "mode" in inspect.signature(pause).parameters
    except (TypeError, ValueError):
        pause_modes = False
    return {
        "collective_rpc": hasattr(engine_cls, "collective_rpc"),
        "pause_generation": pause is not None and hasattr(engine_cls, "resume_generation"),
        "pause_generation(mode=...)": pause_modes,
        # native spans (0.29+), or boundaries the adapter records at each keep-mode pause (0.26: `_Book`)
        "update_weight_version": hasattr(engine_cls, "update_weight_version") or _bookable(engine_cls),
        "add_lora": hasattr(engine_cls, "add_lora") and hasattr(engine_cls, "remove_lora"),
    }


def _bookable(engine_cls: type) -> bool:
    """The engine's output processor tracks per-request states we can read at a pause (vLLM 0.26-0.28)."""
    try:
        from vllm.v1.engine.output_processor import RequestState
    except ImportError:
        return False
    return engine_cls.__name__ == "AsyncLLM" and RequestState is not None


def check_capabilities(engine_cls: type, partial: PartialPolicy) -> None:
    """Refuse an engine class that cannot run this configuration; the error names the capability and fix.

    Every run needs `collective_rpc` (weights load in the workers) and `pause_generation`/`resume_generation`
    with a pause mode (a weight load must never happen mid-generation). `rollout.partial=keep` continues
    requests across a load, so their tokens need per-token versions: `update_weight_version` (whose spans
    label each token with the version that sampled it).
    """
    have = _capabilities(engine_cls)
    fixes = {
        "collective_rpc": "use vLLM >= 0.10 (Relay pins 0.32)",
        "pause_generation": "use a vLLM whose AsyncLLM has pause_generation/resume_generation (Relay pins 0.32)",
        "pause_generation(mode=...)": "use vLLM >= 0.26 (pause modes keep/abort/wait; Relay pins 0.32)",
        "update_weight_version": "use vLLM >= 0.29 (per-token weight-version spans), or set "
        "rollout.partial=resubmit or rollout.partial=off (no request then spans two versions)",
        "add_lora": "use a vLLM whose AsyncLLM has add_lora/remove_lora (Relay pins 0.32)",
    }
    needed = ["collective_rpc", "pause_generation", "pause_generation(mode=...)"]
    if partial.spans_versions:
        needed.append("update_weight_version")
    if partial.adapter_per_version:  # LoRA: each push adds an adapter beside the old ones
        needed.append("add_lora")
    missing = [c for c in needed if not have[c]]
    if missing:
        name = f"{engine_cls.__module__}.{engine_cls.__qualname__}"
        raise EngineCapabilityError(
            f"the vLLM engine {name} lacks {', '.join(missing)}, which rollout.partial={partial} needs: "
            + "; ".join(f"{c}: {fixes[c]}" for c in missing)
        )


def cpu_env(kv_cache_gib: float) -> dict[str, str]:
    """Environment a CPU replica needs before vLLM is imported (see stack-facts: thread binding, KV space).

    A CPU engine runs its one worker inside the engine-core process (`create_engine` asks for the "uni"
    executor, which vLLM's CPU platform turns back into "mp" unless VLLM_ENABLE_V1_MULTIPROCESSING is "0";
    AsyncLLM still starts the engine core as its own process). One process fewer importing torch and vLLM:
    a replica starts about 15 s sooner on 2 cores. The engine core is then where the model runs, so it is
    always spawned, never forked: a fork of a process whose OpenMP pool has run deadlocks (libgomp)."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, int(round(kv_cache_gib)))),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    }


START_LOCK_S = 900.0  # the longest wait for another engine's start on the same GPU (app/vllm/start_lock.py)


def create_engine(
    model_path: str,
    *,
    dtype: str,
    max_model_len: int,
    max_num_seqs: int,
    gpu_memory_utilization: float,
    seed: int = 0,
    use_gpu: bool = False,
    partial: PartialPolicy = partial_policy("keep"),
    cuda_graphs: bool = False,
    lora_rank: int = 0,
    max_loras: int = 4,
    tensor_parallel_size: int = 1,
) -> Any:
    """An AsyncLLM with our worker extension, behaviour log-probs after temperature; eager mode unless
    `cuda_graphs` on a GPU (weights load in place, so captured graphs stay valid across pushes).
    `lora_rank > 0` enables LoRA: up to `max_loras` adapters (versions) in one batch, twice that held.
    `tensor_parallel_size > 1` shards the model over that many worker processes, one per visible GPU.

    Raises EngineCapabilityError before starting anything when the engine cannot serve `rollout.partial`.
    """
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    check_capabilities(AsyncLLM, partial)
    kwargs: dict[str, Any] = dict(
        model=model_path,
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        enforce_eager=not (use_gpu and cuda_graphs),
        seed=seed,
        worker_extension_cls=WORKER_EXTENSION,
        enable_prefix_caching=False,
        # vLLM's own statistics go to a Prometheus registry nothing serves here (Relay's metrics are Ray's),
        # and cost the replica's event loop over a third of its busy time in the loop (profiled at 1.5B on an H100)
        disable_log_stats=True,
        # no weight-loading bar where TQDM_DISABLE is set (app/__main__.py: a log, not a terminal); vLLM
        # passes its own `disable` to tqdm, which then ignores the variable
        use_tqdm_on_load=os.environ.get("TQDM_DISABLE", "").strip().lower() in ("", "0", "false"),
    )
    if use_gpu:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    if tensor_parallel_size > 1:  # worker processes of this replica (vLLM's Ray executor is not used)
        kwargs.update(tensor_parallel_size=tensor_parallel_size, distributed_executor_backend="mp")
    elif not use_gpu:  # the one worker inside the engine core (with `cpu_env`)
        kwargs["distributed_executor_backend"] = "uni"
        _quiet_seed_warning()
    if lora_rank > 0:
        kwargs.update(_lora_args(lora_rank, max_loras))
    fields = getattr(AsyncEngineArgs, "__dataclass_fields__", {})
    if "logprobs_mode" in fields:
        kwargs["logprobs_mode"] = "processed_logprobs"
    # on a GPU, replicas sharing it size their KV caches one after another
    with engine_start_lock(START_LOCK_S) if use_gpu else contextlib.nullcontext():
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))


class _DropMessage(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


_SEED_WARNING = _DropMessage("VLLM_ENABLE_V1_MULTIPROCESSING is set to False")


def _quiet_seed_warning() -> None:
    """vLLM warns on every CPU replica's stdout that VLLM_ENABLE_V1_MULTIPROCESSING=0 may change the random
    state of the process that builds the engine. That process is the replica, which samples nothing itself
    (the engine core does, seeded): the warning is noise a user would read as a problem."""
    logger = logging.getLogger("vllm.engine.arg_utils")
    if _SEED_WARNING not in logger.filters:
        logger.addFilter(_SEED_WARNING)


def _lora_args(rank: int, max_loras: int) -> dict[str, Any]:
    """Engine arguments for adapters of rank `rank`: vLLM takes a `max_lora_rank` from a fixed set of sizes."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    sizes = sorted(int(r) for r in get_args(MaxLoRARanks))
    fits = [r for r in sizes if r >= rank]
    if not fits:
        raise EngineCapabilityError(
            f"model.lora.rank={rank}: this vLLM serves adapters of rank <= {sizes[-1]}"
        )
    return {
        "enable_lora": True,
        "max_lora_rank": fits[0],
        "max_loras": max_loras,
        "max_cpu_loras": 2 * max_loras,
    }


def _lora_kwargs(adapter: Adapter | None) -> dict[str, Any]:
    """`generate`'s keyword for a LoRA adapter (none without one: the base model, as before LoRA)."""
    if adapter is None:
        return {}
    from vllm.lora.request import LoRARequest

    return {"lora_request": LoRARequest(adapter.name, adapter.lora_id, adapter.path)}


async def add_adapter(engine: Any, adapter: Adapter) -> None:
    """Load the PEFT folder `adapter.path` into the engine as `adapter` (replacing one of that id, if held)."""
    from vllm.lora.request import LoRARequest

    req = LoRARequest(adapter.name, adapter.lora_id, adapter.path, load_inplace=True)
    if not await engine.add_lora(req):
        raise RuntimeError(f"vLLM refused adapter {adapter.name} from {adapter.path}")


async def remove_adapter(engine: Any, adapter: Adapter) -> None:
    await engine.remove_lora(adapter.lora_id)


@functools.cache
def _seeded_sampling_ok() -> bool:
    """Per-request seeds: CUDA generators undo a discarded draw by their offset; vLLM's CPU worker cannot ("CPU
    Generator does not use offset" kills the engine core) unless app/vllm/seeded_cpu.py patched its runner,
    which the worker extension does in the engine-core process wherever that runner exists."""
    import torch

    from app.vllm.seeded_cpu import patchable

    return torch.cuda.is_available() or patchable()


class _Book:
    """Per-token versions where the engine has no weight-version spans (vLLM < 0.29).

    While a keep-mode pause lasts nothing is sampled, so once the outputs sent before it are processed, every
    in-flight request's output count is exactly the tokens the old weights sampled. `set_version` (after the
    load) waits for that and `mark` records those counts under the old version; a finished request's tokens are labelled from its marks, the rest with the version at finish.
    Arrival times cannot label tokens: output deltas are merged, so a boundary can fall inside one.
    """

    def __init__(self) -> None:
        self.current: int | None = None
        self.pending = False  # a keep-mode pause happened: mark before the next version is set
        self.marks: dict[tuple[str, int], list[tuple[int, int]]] = {}  # (request, sample) -> [(n, version)]

    def mark(self, engine: Any) -> None:
        """Record, for every in-flight request, how many of its tokens the current version sampled."""
        if self.current is None:
            return
        states = getattr(getattr(engine, "output_processor", None), "request_states", None) or {}
        for st in list(states.values()):
            parent = getattr(st, "parent_req", None)
            rid = getattr(parent, "external_req_id", None) or getattr(st, "external_req_id", None)
            rid = rid or getattr(st, "request_id", "")
            detok = getattr(st, "detokenizer", None)
            n = detok.num_output_tokens() if hasattr(detok, "num_output_tokens") else 0
            self.marks.setdefault((str(rid), int(getattr(st, "request_index", 0) or 0)), []).append(
                (int(n), self.current)
            )

    def versions(self, request_id: str, index: int, n_tokens: int, fallback: int) -> list[int]:
        last = self.current if self.current is not None else fallback
        out: list[int] = []
        for n, v in sorted(self.marks.get((request_id, index), [])):
            out.extend([v] * max(0, min(n, n_tokens) - len(out)))
        return out + [last] * (n_tokens - len(out))

    def forget(self, request_id: str) -> None:
        for key in [k for k in self.marks if k[0] == request_id]:
            del self.marks[key]


def _book(engine: Any) -> _Book | None:
    """The engine's version book, or None where the engine labels tokens itself (update_weight_version)."""
    if hasattr(engine, "update_weight_version"):
        return None
    book = getattr(engine, "_relay_book", None)
    if book is None:
        book = _Book()
        engine._relay_book = book
    return book


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
    top_k: int = 0,
    stop: list[str] | None = None,
    logprobs: bool = True,
    adapter: Adapter | None = None,
) -> list[dict[str, Any]]:
    """Token-in/token-out sampling. Each sample: token_ids, logprobs (of the sampled tokens), finish_reason,
    versions (one per token: native per-token version spans where vLLM has them, else the replica's).
    `top_k` 0 is off; `stop` strings end a response (vLLM checks them on the detokenized text, so only a
    request with stop strings is detokenized; the tokens that produced the string stay in the sample). With
    a LoRA `adapter` every token is sampled by it: each carries its version. `logprobs` false: the engine
    computes no log-probs and each sample's are 0.0 (`rollout.behaviour_logprobs=trainer`)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    if seed is not None and not _seeded_sampling_ok():
        seed = None
    params = SamplingParams(
        n=n,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        stop=list(stop) if stop else None,
        logprobs=0 if logprobs else None,
        seed=seed,
        output_kind=RequestOutputKind.FINAL_ONLY,
        detokenize=bool(stop),
        ignore_eos=ignore_eos,
    )
    final, request_id, book = None, uuid.uuid4().hex, _book(engine)
    try:
        prompt = {"prompt_token_ids": list(prompt_ids)}
        async for out in engine.generate(prompt, params, request_id, **_lora_kwargs(adapter)):
            final = out
        if final is None:
            raise RuntimeError("vLLM returned no output for a generation request")
        if adapter is not None:
            return _samples(final, adapter.version, None, request_id, one_version=True)
        return _samples(final, version, book, request_id)
    finally:
        if book is not None:
            book.forget(request_id)


def sampled_logprobs(logprobs: Any, ids: list[int]) -> list[float]:
    """The log-prob of each sampled token in `ids` (vLLM's dict a position holds the sampled token's); 0.0 each
    where the engine returned none (`rollout.behaviour_logprobs=trainer`). vLLM's `flat_logprobs` lists are
    not used: 7% faster at 512 x 256 on an H200, 14% slower on the long-tailed batch on
    an H100, one run each."""
    if not logprobs:
        return [0.0] * len(ids)
    return [float(logprobs[i][t].logprob) for i, t in enumerate(ids)]


def _samples(
    final: Any, version: int, book: _Book | None, request_id: str, one_version: bool = False
) -> list[dict[str, Any]]:
    samples = []
    for comp in final.outputs:
        ids = list(comp.token_ids)
        lps = sampled_logprobs(comp.logprobs, ids)
        samples.append(
            {
                "token_ids": ids,
                "logprobs": lps,
                "finish_reason": comp.finish_reason or "unknown",
                "versions": (
                    [version] * len(ids)
                    if one_version
                    else book.versions(request_id, int(getattr(comp, "index", 0) or 0), len(ids), version)
                    if book is not None
                    else _spans_to_versions(getattr(comp, "weight_versions", None), len(ids), version)
                ),
            }
        )
    return samples


async def completion_logprobs(
    engine, prompt_ids: list[int], completion_ids: list[int], adapter: Adapter | None = None
) -> list[float]:
    """Log-probs the current weights (base + LoRA `adapter`) assign to a fixed completion (raw model,
    temperature 1)."""
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
    async for out in engine.generate(
        {"prompt_token_ids": ids}, params, uuid.uuid4().hex, **_lora_kwargs(adapter)
    ):
        final = out
    plp = final.prompt_logprobs
    start = len(prompt_ids)
    return [float(plp[i][ids[i]].logprob) for i in range(start, len(ids))]


async def set_version(engine: Any, version: int) -> None:
    """Label tokens sampled from now on with `version`. Engines without it passed `check_capabilities` only
    where no request spans two versions: each sample is then labelled with the replica's version."""
    if hasattr(engine, "update_weight_version"):
        await engine.update_weight_version(str(version))
    else:
        book = _book(engine)
        if book is not None:
            if book.pending:  # a keep-mode pause: what the frozen requests sampled is the old version's
                await _outputs_processed(engine)
                book.mark(engine)
                book.pending = False
            book.current = version


async def _outputs_processed(engine: Any, deadline_s: float = 1.0) -> None:
    """Wait (briefly, bounded) until the outputs the engine core sent before its pause are processed."""
    q = getattr(getattr(engine, "engine_core", None), "outputs_queue", None)
    end = time.monotonic() + deadline_s
    while q is not None and not q.empty() and time.monotonic() < end:
        await asyncio.sleep(0.001)
    await asyncio.sleep(0)  # the output handler's current chunk


async def rpc(engine: Any, method: str, timeout: float | None = None, **kwargs: Any) -> list[Any]:
    """collective_rpc to every worker of this engine (our worker extension's methods). A `timeout` is also
    kept here: the one-process ("uni") executor of a CPU engine ignores the engine-side one."""
    call = engine.collective_rpc(method, timeout=timeout, kwargs=kwargs)
    return await (call if timeout is None else asyncio.wait_for(call, timeout))


async def pause(
    engine: Any, partial: PartialPolicy = partial_policy("keep"), recompute_kv: bool = True
) -> None:
    """Pause generation for a weight load. `keep`: in-flight requests freeze and continue after resume with
    their KV cache recomputed; `resubmit`: they are aborted (the caller resubmits them); `off`: they finish
    under the old weights first. (`check_capabilities` made sure the engine has it: never skipped.)

    `recompute_kv=False` (keep only) leaves the frozen requests' KV cache as the old weights computed it
    (nothing is preempted or recomputed).

    The pause goes to the engine core directly and never asks it to clear its cache wholesale: vLLM's
    `clear_cache=True` walks every block of the KV cache in Python to drop prefix hashes (about 0.5 s a push
    for the embedded model on an H200, where the cache has millions of blocks), and Relay's engines keep no
    prefix cache (`create_engine`). Only where requests are frozen and `recompute_kv` holds are they preempted
    (`reset_prefix_cache(reset_running_requests=True)`), so that they recompute their KV under the new weights.
    `pause_generation` would also add a fixed 20 ms sleep; the version book reads the outputs only at
    `set_version`, after the load."""
    mode, core = partial.pause_mode, getattr(engine, "engine_core", None)
    if mode is None:
        raise ValueError(f"rollout.partial={partial} never pauses generation for a push")
    clear = _prefix_caching(engine)  # stale prefix hashes must go; without a prefix cache there are none
    if hasattr(core, "pause_scheduler_async"):
        await core.pause_scheduler_async(mode=mode, clear_cache=clear)
    else:
        await engine.pause_generation(mode=mode, clear_cache=clear or (recompute_kv and partial.freezes))
    if partial.freezes and recompute_kv and not clear and _has_unfinished(engine):
        await engine.reset_prefix_cache(reset_running_requests=True)  # the frozen ones recompute their KV
    book = _book(engine)
    if book is not None:  # frozen requests resume under the next version: mark them at `set_version`
        book.pending = partial.freezes


async def paused_call(
    engine: Any, partial: PartialPolicy, recompute_kv: bool, method: str, **kwargs: Any
) -> tuple[list[Any], float, float]:
    """Pause generation (`pause`) and run `method` in every worker (a weight load); return its results and the
    seconds from the start to the pause's answer and to the call's.

    Where the pause stops every step at once (`partial.stops_at_once`: keep freezes every request, abort ends
    them, where wait lets the running ones step on, so its load must wait for the pause's answer) and goes to the engine core directly, the call
    goes out right behind it instead of after its answer. The engine core takes its input in order, in one
    thread, and runs no step once it took such a pause, so no step falls between the pause and the load; a
    step still in flight ran its kernels on the stream the workers then queue their loads on, so the loads
    come after it on the device (so do the receives: NCCL's stream waits for the work queued before it). The
    workers post their receives while that step ends, and they start on the device as soon as it ended,
    where before the pause's answer (which waits for it) and the call's dispatch came first. Otherwise:
    pause, then call (`PauseFailed` where that pause fails). Either way the pause has finished (its cache reset
    and version book included) on return."""
    t0 = time.perf_counter()
    if not partial.stops_at_once or not hasattr(
        getattr(engine, "engine_core", None), "pause_scheduler_async"
    ):
        try:
            await pause(engine, partial, recompute_kv)
        except Exception as e:
            raise PauseFailed(str(e)) from e
        t1 = time.perf_counter()
        return await rpc(engine, method, **kwargs), t1 - t0, time.perf_counter() - t0

    async def timed_pause() -> float:
        await pause(engine, partial, recompute_kv)
        return time.perf_counter()

    task = asyncio.ensure_future(timed_pause())
    await asyncio.sleep(0)  # the pause's first step sends its message: the call's goes out behind it
    try:
        res = await rpc(engine, method, **kwargs)
        called = time.perf_counter() - t0
    finally:
        paused = await asyncio.shield(task)  # the pause finishes before anything resumes the engine
    return res, paused - t0, called


def _prefix_caching(engine: Any) -> bool:
    """Whether the engine keeps a prefix cache (unknown: assume it does, the safe answer)."""
    cache = getattr(getattr(engine, "vllm_config", None), "cache_config", None)
    return bool(getattr(cache, "enable_prefix_caching", True))


def _has_unfinished(engine: Any) -> bool:
    """Requests in flight in the engine (unknown: assume some)."""
    proc = getattr(engine, "output_processor", None)
    return bool(proc.has_unfinished_requests()) if hasattr(proc, "has_unfinished_requests") else True


async def resume(engine: Any) -> None:
    await engine.resume_generation()


def engine_dead(engine: Any) -> bool:
    """True once the engine can never serve again: its core process died (the OOM killer, a crash) or its
    output loop ended. vLLM's AsyncLLM says so in `errored`; its requests then raise EngineDeadError."""
    return bool(getattr(engine, "errored", False))


async def check_health(engine: Any) -> None:
    """Raise (vLLM's EngineDeadError) when the engine is dead; a replica's health check calls this."""
    if hasattr(engine, "check_health"):
        await engine.check_health()
    elif engine_dead(engine):
        raise RuntimeError("the vLLM engine is dead")


def shutdown(engine: Any) -> None:
    if engine is not None and hasattr(engine, "shutdown"):
        engine.shutdown()
