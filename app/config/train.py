"""`train.*` and `ref.*`: the FSDP2 trainer (workers, batches, optimizer, checkpoints) and its KL reference."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from app.config.base import _SEED, _SHARE, _TIMEOUT, Backend, Dtype, Range, _Section, require, rng


@dataclass
class TrainConfig(_Section):
    steps: int = 60
    """Training steps (= weight versions) of the run: each trains one batch (`algorithm.ppo_epochs` x
    mini-batches optimizer steps, one by default)."""
    workers: int = 1
    """Ray Train workers (FSDP2 ranks). One by default: a small CPU job's ranks cost start-up and per-step
    messages, not compute; the GPU presets and `resources.train_gpus` set more."""
    worker_cpus: float = 1.0
    """Logical CPUs per Ray Train worker."""
    use_gpu: bool = False
    """Train on GPUs (`worker_gpus` per worker, NCCL) instead of CPU (gloo; the workers then see no GPU)."""
    worker_gpus: float = 1.0
    """With use_gpu: GPUs per Ray Train worker, 1 or a share of one GPU (e.g. 0.5, next to a replica with
    rollout.replica_gpus=0.4: one GPU for the whole run, see configs/gpu1.yaml)."""
    batch_groups: int = 16
    """Prompt groups per optimizer step (each of `rollout.n` samples)."""
    micro_batch_size: int = 0
    """At most this many sequences per forward/backward on one worker (verl's `ppo_micro_batch_size_per_gpu`),
    packed or padded; 0: no limit of its own (packed passes are bounded by `micro_batch_tokens`, a padded one
    takes the worker's whole share). Lower it (or `micro_batch_tokens`) when a step runs out of memory."""
    micro_batch_tokens: int = 16384
    """Tokens per packed micro-batch: sequences are concatenated without padding (each attends only to
    itself) and packed into forward/backward passes of at most this many tokens and at most
    `micro_batch_size` sequences (a longer sequence gets a pass of its own). 0: no packing: padded
    micro-batches of `micro_batch_size` sequences, right-padded to the longest."""
    logprob_chunk_tokens: int = 1024
    """Token log-probs (and entropy) are computed from the last hidden states and the output embedding this
    many tokens at a time, recomputed in the backward pass, so no [tokens x vocab] float32 logits are held.
    0: the full logits of the micro-batch at once (the reference path)."""
    log_entropy: bool = True
    """Compute `actor/entropy` (one more pass over each chunk of logits)."""
    packed_attention: Literal["auto", "varlen", "per_seq"] = "auto"
    """Attention of packed micro-batches: `varlen` (FlashAttention's variable-length kernel through
    torch.nn.attention.varlen; CUDA, bf16), `per_seq` (causal sdpa inside each sequence, one call a sequence
    length; any device), `auto` (varlen where it applies, else per_seq)."""
    reshard_after_forward: bool = True
    """FSDP2: free each decoder layer's gathered parameters after its forward (and gather again for the
    backward); false keeps them, trading memory for one all-gather per layer and step."""
    reduce_dtype: Dtype = "float32"
    """FSDP2 gradient reduction dtype with model.dtype=bfloat16 (`bfloat16` halves the reduce-scatter)."""
    gather_once: Literal["auto", "on", "params", "off"] = "auto"
    """FSDP2 gradient accumulation: gather each layer's parameters once per step and keep them through every
    micro-batch, accumulating unsharded gradients (in `reduce_dtype`) and reduce-scattering once at the end of
    the step, instead of a gather and a reduce-scatter per micro-batch. Costs a full copy of the parameters
    (compute dtype) and of the gradients (`reduce_dtype`) per rank while the step runs. `params`: keep the
    gathered parameters only (one all-gather per layer and step; gradients still reduce-scattered after each
    micro-batch, so they stay sharded). `auto`: on with one trainer rank (nothing is sharded there; +2.5 GiB
    at 1.5B), off with several (it would give up FSDP's memory savings)."""
    optimizer_impl: Literal["auto", "foreach", "fused"] = "auto"
    """AdamW implementation: `fused` (one kernel per parameter group, step counters on the device: no host
    reads in the step), `foreach` (torch's default), `auto` (fused on GPU, foreach on CPU)."""
    cuda_alloc_conf: str = "auto"
    """`PYTORCH_CUDA_ALLOC_CONF` of the GPU trainer workers. `auto`: `expandable_segments:True` (micro-batches
    of varying length no longer fragment the caching allocator: a 1.5B step went from 1.33-1.41 s to 1.13 s on
    an H100), unless the driver's environment sets the variable; `""`: torch's default; anything else is
    passed as is. (The CUDA-IPC push allocates its staging buffer outside expandable segments.)"""
    compile: Literal["auto", "on", "off"] = "auto"
    """`torch.compile` the RMSNorm and SwiGLU MLP of every decoder layer (app/trainer/compiled.py: fewer passes over
    the activations, fewer kernel launches, less memory saved for backward). `auto`: on with GPUs, off on CPU
    (compiling costs more than it saves on small CPU runs)."""
    warm_up: Literal["auto", "on", "off"] = "auto"
    """Run the trainer's forward and backward on two synthetic micro-batches (gradients dropped, weights
    untouched) while the first batch is generated, so `torch.compile`'s work overlaps that generation instead
    of delaying the first step (app/trainer/warm_up.py). `auto`: where the layers are compiled."""
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    """AdamW betas."""
    grad_clip: float = 1.0
    """Gradient-norm clipping threshold."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up, in optimizer steps (0: none)."""
    backend: Backend = "auto"
    """Default process group of the trainer: gloo on CPU, nccl on GPU."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    seed: int = 0
    """Seed of the trainer's torch RNG."""
    timeout_s: float = 300.0
    """Timeout of the trainer's collectives and of each wait for a rollout batch."""
    save_every: int = 0
    """Save a checkpoint of the whole pipeline (sharded model and optimizer, RNG, version, prompt stream,
    queued groups, partial rollouts) every this many steps (0: only when the run ends or stops cleanly)."""
    keep_checkpoints: int = 2
    """Checkpoints kept under `<run_dir>/<run>/ray_train` (older ones are deleted)."""
    resume: str = ""
    """Continue from a checkpoint: its directory, or a run directory (its newest checkpoint). Also
    `python -m app train --resume PATH`."""
    max_failures: int = 0
    """Trainer-worker failures Ray Train recovers from by restarting the workers from the last checkpoint."""
    stall_timeout_s: float = 900.0
    """Watchdog: if no training step completes for this long, the run fails with a report of what every
    role was waiting for (written to `<run_dir>/<run>/stall_report.json`)."""
    max_skipped_steps: int = 3
    """Steps with a non-finite loss or gradient are skipped (`train/skipped_steps`); past this many the run
    fails, with the prompt ids of each such batch saved under `<run_dir>/<run>/nonfinite/`."""

    _RANGES: ClassVar[dict[str, Range]] = {
        "steps": rng(">= 1"),
        "workers": rng(">= 1"),
        "worker_cpus": _SHARE,
        "worker_gpus": rng("(0, 1]", "a worker is one FSDP2 rank on one GPU, or a share of one"),
        "batch_groups": rng(">= 1"),
        "micro_batch_size": rng(">= 0", "0: no limit on sequences per pass"),
        "micro_batch_tokens": rng(">= 0", "0: padded micro-batches of micro_batch_size sequences"),
        "logprob_chunk_tokens": rng(">= 0", "0: full logits at once"),
        "lr": rng("> 0"),
        "weight_decay": rng(">= 0", "negative decay pushes weights away from zero"),
        "grad_clip": rng("> 0", "0 zeroes every gradient and a negative threshold flips it: gradient ascent"),
        "warmup_steps": rng(">= 0", "0: no warm-up"),
        "seed": _SEED,
        "timeout_s": _TIMEOUT,
        "save_every": rng(">= 0", "0: only when the run ends"),
        "keep_checkpoints": rng(">= 1"),
        "max_failures": rng(">= -1", "-1: unlimited"),
        "stall_timeout_s": _TIMEOUT,
        "max_skipped_steps": rng(">= 0"),
    }

    def check(self, prefix: str) -> None:
        super().check(prefix)
        betas = list(self.betas)
        require(
            f"{prefix}betas",
            len(betas) == 2 and all(math.isfinite(b) and 0 <= b < 1 for b in betas),
            f"{betas}; must be two numbers in [0, 1) (AdamW's moment decay rates; 1 never forgets, a "
            f"negative one oscillates), e.g. {prefix}betas=[0.9,0.99]",
        )
        require(
            f"{prefix}worker_gpus",
            not self.use_gpu or self.worker_gpus >= 1 or self.workers == 1,
            f"{self.worker_gpus:g} with {prefix}workers={self.workers}: workers sharing GPUs could land on one "
            f"GPU, where NCCL cannot put two ranks; use {prefix}worker_gpus=1, or {prefix}workers=1",
        )


@dataclass
class RefConfig(_Section):
    workers: int = 0
    """With algorithm.kl_coef > 0: Ray actors holding the frozen initial policy that compute reference
    log-probs of finished trajectories in the pipeline, before they reach the trainer; 0 keeps a frozen
    copy in the trainer instead."""
    worker_cpus: float = 0.5
    """Logical CPUs per reference worker."""
    worker_gpus: float = 0.0
    """GPUs per reference worker (0: CPU)."""

    _RANGES: ClassVar[dict[str, Range]] = {
        "workers": rng(">= 0", "0: the trainer keeps the reference"),
        "worker_cpus": _SHARE,
        "worker_gpus": _SHARE,
    }
