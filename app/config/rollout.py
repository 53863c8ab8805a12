"""`rollout.*`: the vLLM replicas of the rollout role, their sampling, scaling and in-flight weight updates."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from app.config.base import (
    _SHARE,
    _TIMEOUT,
    BehaviourLogprobs,
    ConfigError,
    Partial,
    Range,
    Scaling,
    _Section,
    require,
    rng,
)
from app.infra.resources import samples_per_request


@dataclass
class RolloutConfig(_Section):
    n: int = 8
    """Samples per prompt (the GRPO group)."""
    max_tokens: int = 8
    """Maximum response tokens."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts (behaviour log-probs are taken after it)."""
    top_p: float = 1.0
    """Nucleus sampling of training rollouts."""
    top_k: int = 0
    """Top-k sampling of training rollouts (0: off). Like `top_p` and `temperature` it shapes the behaviour
    log-probs (taken after them), which the trainer's own (the raw model's) are compared with."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a response (training and validation), e.g. `["</answer>"]`; the tokens that wrote
    the string stay in the response (they were sampled, so they are trained)."""
    min_replicas: int = 1
    """Minimum (and initial) number of vLLM replicas in the Serve deployment."""
    max_replicas: int = 1
    """Maximum replicas; above `min_replicas` Serve autoscales on ongoing requests."""
    target_ongoing_requests: float = 16.0
    """Serve autoscaling target per replica, in samples generating or waiting (only used when max_replicas >
    min_replicas; with `group_requests` Serve gets it in groups, divided by `n`)."""
    scaling: Scaling = "auto"
    """auto: Serve autoscales between min_replicas and max_replicas on ongoing requests; external: start
    min_replicas and let an operator scale through Serve's REST API (POST
    /api/v1/applications/<ray.name>-rollout/deployments/rollout/scale)."""
    ignore_eos: bool = False
    """Always generate `max_tokens` tokens (benchmarks, and tests of long generations with a tiny model)."""
    lengths: str = "fixed"
    """Benchmarks: `fixed`, or `pareto:ALPHA:MIN` to give each prompt group a long-tailed response length
    min(max_tokens, MIN x Pareto(ALPHA)) (seeded by prompt id; needs `ignore_eos` so lengths are exact)."""
    max_inflight: int = 32
    """fully_async: prompt groups generating at once (admission control may hold fewer)."""
    partial: Partial = "keep"
    """What a push does to generations in flight: `keep` freezes them and continues under the new weights
    (KV cache recomputed), `resubmit` aborts them and resubmits prompt + partial response, `off` lets them
    finish under the old weights before loading. Tokens always keep the version that produced them.
    `finish_on_old` (LoRA only, and its default when `model.lora.rank > 0`): no pause at all; the pushed
    adapter is loaded beside the old ones, requests in flight finish on the adapter they were admitted
    under and new ones take the new one, so every sample carries one version."""
    recompute_kv: bool = True
    """With `partial=keep`: after a push, the frozen generations' KV cache is recomputed with the new weights
    (a prefill of every context in flight, each push: on one H100 it took 76-277 ms of generation with 64
    sequences of a 1.5B model, docs/benchmarks.md). false keeps the cache (PipelineRL's in-flight update): the
    pause is the load alone, and the tokens after a push attend to keys and values the old weights computed.
    Their behaviour log-probs are what the sampler saw, so the off-policy correction still applies."""
    behaviour_logprobs: BehaviourLogprobs = "engine"
    """Where the behaviour log-probs come from. `engine`: vLLM returns each sampled token's (what the sampler
    saw). `trainer`: vLLM returns none and the trainer's own log-probs at the step's start stand in (verl's
    recomputed `old_log_prob`): at 512 sequences a step of a 1.5B engine on an H100 is CPU-bound in vLLM's
    handling of the per-token log-probs; without them a 512-sequence step ran 1.6x faster and a long-tailed
    batch 1.46x (docs/benchmarks.md). The trainer's log-probs are the current policy's, not the sampler's:
    the ratio then corrects neither the vLLM/trainer numerical gap nor one_step_off's one-version lag, so
    only `algorithm.correction=none` takes it (and `mode=sync`/`one_step_off`)."""
    group_requests: bool = True
    """One Serve request per group: the replica runs the group's `n` samples, each seeded as its own
    request would be (so the tokens are the same), and answers when the last ends. false: one request per
    sample, whose reward then starts the moment it ends, not when its group does. Serve routes each request
    in the caller's one router thread, about a millisecond each on a CPU core: on CPU a 1,024-sample step of
    4-token answers generated in 0.7-0.8 s a step by group against 2.0-2.3 s by sample, and the embedded
    default's step in 0.27 s against 0.43 s (docs/benchmarks.md). Multi-turn episodes and
    restored partial groups go by sample either way. `max_ongoing_requests` counts requests, so groups
    here."""
    join_timeout_s: float = 600.0
    """Deadline for a replica started mid-run to receive the current weights before it may serve."""
    replica_cpus: float = 1.0
    """Logical CPUs (or GPUs on a GPU cluster, see `replica_gpus`) per vLLM replica."""
    replica_gpus: float = 0.0
    """GPUs per replica (0 runs vLLM on CPU). With `tensor_parallel_size` > 1 the replica's GPUs are spread
    over that many GPUs: each worker takes `replica_gpus / tensor_parallel_size` of its own GPU (a whole GPU,
    or a share of one beside a trainer rank, as `resources.colocate` sets it)."""
    tensor_parallel_size: int = 1
    """vLLM workers per replica, each holding a shard of the model on its own GPU (vLLM's tensor
    parallelism). Every worker receives each push and loads its shard; GPU replicas only."""
    max_model_len: int = 128
    """vLLM context length; must hold `data.max_prompt_tokens + rollout.max_tokens`."""
    kv_cache_gib: float = 1.0
    """KV-cache size per replica on CPU (VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float | None = None
    """Fraction of its GPU's memory a GPU replica's vLLM may take (weights + KV cache); null: the replica's
    GPU share (`replica_gpus` under 1, e.g. 0.4), or 0.9 for a whole GPU."""
    max_num_seqs: int = 256
    """Maximum sequences a replica batches at once."""
    max_ongoing_requests: int | None = None
    """Generation requests a replica holds at once (Serve's `max_ongoing_requests`); more wait in the
    caller's Serve router. null: a whole step's samples (`train.batch_groups`, or `max_inflight` groups, of
    `n`), at least twice `max_num_seqs` and 64 (`max_num_seqs` with `partial=off`, whose push first
    finishes every request inside the replica), so that vLLM's own queue fills a finished sequence's slot at
    its next step. Past the cap the router refills it: with one replica from two routing tasks that back off
    up to 0.5 s while the replica is full, so the engine runs under its batch while a long-tailed batch's
    short samples finish (on CPU, 128 samples through 16 slots: 2.4-9.4 s a step against 0.65 s,
    docs/benchmarks.md). Not below `max_num_seqs`."""
    cuda_graphs: bool = False
    """GPU replicas: capture CUDA graphs for decoding (shorter steps, so more tokens/s and a shorter pause
    before each weight load; costs start-up time and some memory). Off: eager mode. Ignored on CPU."""
    request_timeout_s: float = 120.0
    """Deadline for one generation request."""

    _RANGES: ClassVar[dict[str, Range]] = {
        "n": rng(">= 2", "GRPO needs at least 2 samples per prompt to compare"),
        "max_tokens": rng(">= 1"),
        "temperature": rng("> 0", "training rollouts must sample; greedy gives identical group members"),
        "top_p": rng("(0, 1]"),
        "top_k": rng(">= 0", "0: off"),
        "min_replicas": rng(">= 1"),
        "max_replicas": rng(">= 1"),
        "target_ongoing_requests": rng("> 0"),
        "max_inflight": rng(">= 1"),
        "join_timeout_s": _TIMEOUT,
        "replica_cpus": _SHARE,
        "replica_gpus": _SHARE,
        "tensor_parallel_size": rng(">= 1"),
        "max_model_len": rng(">= 1"),
        "kv_cache_gib": rng("> 0", "vLLM needs room for at least one sequence's KV cache"),
        "gpu_memory_utilization": rng("(0, 1]", "a fraction of the GPU's memory"),
        "max_num_seqs": rng(">= 1", "0 sequences per batch generates nothing"),
        "max_ongoing_requests": rng(">= 1"),
        "request_timeout_s": _TIMEOUT,
    }

    def check(self, prefix: str) -> None:
        super().check(prefix)
        try:
            parse_lengths(self.lengths)
        except ValueError as e:
            raise ConfigError(f"invalid value for '{prefix}lengths': {e}") from None
        require(
            f"{prefix}lengths",
            self.lengths == "fixed" or self.ignore_eos,
            f"{self.lengths!r}: a length distribution needs {prefix}ignore_eos=true (else EOS ends responses "
            "early)",
        )
        require(
            f"{prefix}recompute_kv",
            self.recompute_kv or self.partial == "keep",
            f"false applies to {prefix}partial=keep only (it is {self.partial!r}: its generations are "
            f"{'resubmitted' if self.partial == 'resubmit' else 'finished before the load'}, nothing is "
            "frozen); drop it or set partial=keep",
        )
        require(
            f"{prefix}stop",
            all(isinstance(x, str) and x for x in self.stop),
            f"{list(self.stop)!r}: every stop string must be non-empty (an empty one would end every response "
            f'at once), e.g. {prefix}stop=["</answer>"]',
        )
        require(
            f"{prefix}max_replicas",
            self.max_replicas >= self.min_replicas,
            f"{self.max_replicas} is below {prefix}min_replicas={self.min_replicas}; raise it or lower that",
        )
        per = samples_per_request(self)
        held = None if self.max_ongoing_requests is None else self.max_ongoing_requests * per
        require(
            f"{prefix}max_ongoing_requests",
            held is None or held >= self.max_num_seqs,
            f"{self.max_ongoing_requests} requests of {per} sample(s) are below {prefix}max_num_seqs="
            f"{self.max_num_seqs}, so a replica could never batch max_num_seqs sequences; raise it, or null "
            "(twice max_num_seqs)",
        )
        self._check_gpu_share_per_worker(prefix)

    def _check_gpu_share_per_worker(self, prefix: str) -> None:
        tp, gpus = self.tensor_parallel_size, self.replica_gpus
        if tp == 1 or gpus == 0:  # (a CPU replica with tp > 1 is refused once resources are resolved)
            return
        per = gpus / tp
        require(
            f"{prefix}tensor_parallel_size",
            per <= 1 + 1e-9 and (per > 1 - 1e-9 or gpus < tp),
            f"{tp} workers on replica_gpus={gpus:g} gives each worker {per:g} GPUs; a worker takes one GPU or a "
            f"share of one: set {prefix}replica_gpus to {tp} (whole GPUs) or to {tp} x a share under 1",
        )


def parse_lengths(spec: str) -> tuple[float, int] | None:
    """`fixed` -> None; `pareto:ALPHA:MIN` -> (ALPHA, MIN). Raises ValueError naming the valid forms."""
    if spec == "fixed":
        return None
    parts = spec.split(":")
    try:
        if parts[0] != "pareto" or len(parts) != 3:
            raise ValueError
        alpha, low = float(parts[1]), int(parts[2])
    except ValueError:
        raise ValueError(f"{spec!r}; use `fixed` or `pareto:ALPHA:MIN` (e.g. pareto:1.2:4)") from None
    if not (alpha > 0 and math.isfinite(alpha)) or low < 1:
        raise ValueError(f"{spec!r}: ALPHA must be a finite number > 0 and MIN >= 1")
    return alpha, low
