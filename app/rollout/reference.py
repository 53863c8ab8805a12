"""Reference log-probs off the trainer.

With `algorithm.kl_coef > 0` and `ref.workers > 0`, the frozen initial policy lives on its own workers (Ray
actors holding the HF model, CPU or GPU per `ref.worker_gpus`): the rollouter sends every finished group
there, in the pipeline, and the group reaches the trainer with `Sample.ref_logprobs` filled in. The trainer
then keeps no reference copy and runs no reference forward pass. The computation is the trainer's own
(`collate` + `scored_logprobs`: chunked log-probs from the last hidden states and the output embedding, no
[tokens x vocab] float32 logits), so the numbers agree with what a trainer-side reference would compute
(up to attention kernels: the reference pads a group's completions, the trainer may pack them).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)


class RefWorker:
    """The frozen initial policy; `logprobs(prompt_ids, completions)` -> per-token log-probs of each."""

    def __init__(
        self, model_path: str, dtype: str = "float32", use_gpu: bool = False, chunk_tokens: int = 1024
    ) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        self.device = torch.device("cuda") if use_gpu else torch.device("cpu")
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(
            self.device
        )
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        hf = AutoConfig.from_pretrained(model_path)
        self.pad_id = hf.pad_token_id if hf.pad_token_id is not None else 0
        self.chunk_tokens = chunk_tokens  # train.logprob_chunk_tokens

    def logprobs(self, prompt_ids: list[int], completions: list[list[int]]) -> list[list[float]]:
        import torch

        from app.trainer.batch_tensors import Row, collate, row_values
        from app.trainer.logprobs import scored_logprobs

        out: list[list[float]] = [[] for _ in completions]
        idx = [i for i, c in enumerate(completions) if c]
        if not idx:
            return out
        rows = [Row(prompt_ids, completions[i], [0.0] * len(completions[i]), 0.0, []) for i in idx]
        mb = collate(rows, self.pad_id, self.device)
        with torch.no_grad():
            logp, _ = scored_logprobs(self.model, mb, self.chunk_tokens)
        for j, (i, row) in enumerate(zip(idx, rows, strict=True)):
            out[i] = row_values(mb, logp, j, row)
        return out


class RefPool:
    """The rollouter's handle on the reference workers: `await pool.fill(group)` sets ref log-probs."""

    def __init__(self, cfg: Any, model_path: str) -> None:
        import ray

        from app.infra.resources import role_env

        r = cfg.ref
        cls = ray.remote(RefWorker)
        self.workers = [
            cls.options(
                name=f"{cfg.ray.name}-ref-{i}",
                num_cpus=r.worker_cpus,
                num_gpus=r.worker_gpus,
                runtime_env={"env_vars": role_env(r.worker_gpus)},  # a CPU reference sees no GPU
                max_restarts=-1,
                max_task_retries=2,  # a pure function of its inputs: safe to retry on a restarted worker
            ).remote(model_path, cfg.model.dtype, r.worker_gpus > 0, cfg.train.logprob_chunk_tokens)
            for i in range(r.workers)
        ]
        self.busy = [0] * len(self.workers)
        self.timeout_s = cfg.rollout.request_timeout_s

    async def fill(self, group: Any) -> None:
        i = min(range(len(self.workers)), key=self.busy.__getitem__)
        self.busy[i] += 1
        try:
            ref = self.workers[i].logprobs.remote(group.prompt_ids, [s.token_ids for s in group.samples])
            try:
                lps = await asyncio.wait_for(ref, timeout=self.timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError(
                    f"reference worker {i} did not return log-probs for prompt {group.uid} within "
                    f"rollout.request_timeout_s={self.timeout_s}s"
                ) from None
        finally:
            self.busy[i] -= 1
        for s, lp in zip(group.samples, lps, strict=True):
            s.ref_logprobs = lp
