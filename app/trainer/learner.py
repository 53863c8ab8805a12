"""Training: GRPO on a model sharded with FSDP2, run by Ray Train's TorchTrainer.

`Learner` holds the sharded policy (and, with a KL penalty, a frozen sharded reference) and does one
optimizer step on a `Batch` with the loss `algorithm.correction` picks from `app.trainer.losses.LOSSES`; it needs
torch alone (the GPU tier runs it without Ray). The per-worker loop around it is app/train_loop.py. Its parts:
the model (app/trainer/model_build.py), the batch's tensors (batch_tensors.py), log-probs (logprobs.py), the
step's metrics (update_metrics.py), the push's gather (push_gather.py) and the final export (hf_export.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from app.plugins import resolve
from app.records import Batch
from app.trainer import grpo, lora
from app.trainer.batch_tensors import Row, Update, collate, flatten_batch, row_values, split_rows
from app.trainer.hf_export import export_hf
from app.trainer.logprobs import micro_logprobs
from app.trainer.losses import LOSSES, LossInputs
from app.trainer.minibatch import merge_updates, mini_batches
from app.trainer.model_build import build_fsdp_model, param_name, reshard
from app.trainer.packing import collate_packed, packing_enabled
from app.trainer.push_gather import gather_params
from app.trainer.update_metrics import SUMS, micro_sums, reduce_sums, update_metrics


def stand_in_behaviour(logprobs: torch.Tensor, proximal: torch.Tensor | None) -> torch.Tensor:
    """`rollout.behaviour_logprobs=trainer`: the behaviour log-probs are the trainer's at the step's start, the
    proximal pass's where a batch takes several optimizer steps, else this forward's (detached, no extra
    pass). The ratio to them is then PPO's trust region alone (1 at a batch's first step)."""
    return (logprobs if proximal is None else proximal).detach()


class Learner:
    """One optimizer step of GRPO on this rank's share of a batch (all ranks step in lock-step)."""

    def __init__(self, cfg: Any, model_path: str, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        t = cfg.train
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(model_path)
        self.pad_id = hf.pad_token_id if hf.pad_token_id is not None else 0
        # a model type the packed path does not serve trains padded (one warning, from rank 0)
        self.packed = packing_enabled(t.micro_batch_tokens, hf.model_type, announce=self.rank == 0)
        # the old path (padded, full logits) stays as it was, for comparison
        self.reference_path = not self.packed and t.logprob_chunk_tokens == 0
        on_gpu = device.type == "cuda"
        build = dict(
            packed=self.packed,
            reshard_after_forward=t.reshard_after_forward,
            reduce_dtype=t.reduce_dtype,
            compile_layers=t.compile == "on" or (t.compile == "auto" and on_gpu),
        )
        # gather_once keeps the gathered layers through the step (resharded after its last backward), and
        # with "on" also the unsharded gradients (reduce-scattered once, after the last backward)
        self.gather_once = dist.is_initialized() and (
            t.gather_once in ("on", "params") or (t.gather_once == "auto" and self.world == 1)
        )
        self.sync_every_micro = t.gather_once == "params"
        self.lora = lora.LoraSpec.from_config(cfg.model.lora)  # None: full fine-tuning
        self.model = build_fsdp_model(
            model_path,
            cfg.model.dtype,
            device,
            t.activation_checkpointing,
            **{**build, "reshard_after_forward": t.reshard_after_forward and not self.gather_once},
            adapters=self.lora,
        )
        self.ref = None
        # the KL reference: the reference workers', or a frozen copy here; with LoRA the base itself (adapters off)
        if cfg.algorithm.kl_coef > 0 and cfg.ref.workers == 0 and self.lora is None:
            self.ref = build_fsdp_model(model_path, cfg.model.dtype, device, train=False, **build)
        fused = t.optimizer_impl == "fused" or (t.optimizer_impl == "auto" and on_gpu)
        self.opt = torch.optim.AdamW(
            lora.trainable_params(self.model),  # every parameter, or the adapters alone
            lr=t.lr,
            betas=tuple(t.betas),
            weight_decay=t.weight_decay,
            **({"fused": True} if fused else {"foreach": None}),
        )
        warm = max(0, t.warmup_steps)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0
        )
        self.loss_fn = resolve("algorithm.correction", cfg.algorithm.correction, LOSSES)
        # rollout.behaviour_logprobs=trainer: the engine returned none; the step's start policy stands in
        self.engine_behaviour = cfg.rollout.behaviour_logprobs == "engine"

    def step(self, batch: Batch) -> dict[str, float]:
        """Train on `batch` (collective: every rank calls it with the same batch): one optimizer step per
        mini-batch of `algorithm.ppo_mini_batch_size` groups, `algorithm.ppo_epochs` times over (one step by
        default; app/trainer/minibatch.py). With several, the trainer's log-probs of the whole batch are
        computed first, without gradient, and every update's loss clips against them
        (`LossInputs.proximal_logprobs`); the behaviour log-probs keep their role in the off-policy
        corrections. Returns the step's metrics (`actor/optimizer_steps`: the optimizer steps taken)."""
        a = self.cfg.algorithm
        ups = [self._layout(part) for part in mini_batches(batch, a.ppo_mini_batch_size)]
        several = len(ups) * a.ppo_epochs > 1
        if several:
            self._proximal(ups)
        order = [u for _ in range(a.ppo_epochs) for u in ups]
        out = merge_updates(
            [self._update(u) for u in order], [u.tokens for u in order], sum(u.tokens for u in ups)
        )
        if not several:  # the proximal policy is the current one: nothing to measure
            out.pop("actor/ppo_kl", None)
        if not (self.cfg.train.log_entropy or a.entropy_coef > 0):  # not computed
            out.pop("actor/entropy", None)
        return out

    def _layout(self, batch: Batch) -> Update:
        """One update's micro-batches on this rank, laid out and copied to the device up front."""
        rows = flatten_batch(batch, self.cfg.algorithm.normalize_adv_std)
        parts, n_micro = self._plan(rows)
        mbs = [self.collate(p) for p in parts]
        filler = None
        if len(mbs) < n_micro:
            pool = [r for p in parts for r in p] or rows
            filler = self.collate([min(pool, key=lambda r: len(r.prompt_ids) + len(r.response_ids))])
        tokens = float(sum(r.loss_tokens for r in rows))
        return Update(mbs=mbs, n_micro=n_micro, filler=filler, tokens=tokens, seqs=float(len(rows)))

    def _proximal(self, ups: list[Update]) -> None:
        """The trainer's own log-probs of every micro-batch before the batch's first update (`mb["prox"]`),
        in the updates' mode and without gradient. Every rank runs as many passes as in an update (FSDP2)."""
        self.model.train()
        with torch.no_grad():
            for u in ups:
                for mb, _ in u.passes():
                    mb["prox"] = self.logprobs(self.model, mb)[0]
        if self.gather_once:  # without a backward the layers stay gathered: free them before the updates
            reshard(self.model)

    def _update(self, u: Update) -> dict[str, float]:
        """One optimizer step on an update's micro-batches (collective).

        Every rank runs the same number of forward/backward passes (FSDP2 collectives): a rank with fewer
        micro-batches runs zero-weight passes on a copy of one row. Metric sums stay on the device until the
        step ends (no host synchronisation inside the micro-batch loop).
        """
        sums = self._accumulate(u)
        grad_norm = self._optimizer_step()
        lr = self.sched.get_last_lr()[0]
        return update_metrics(reduce_sums(sums), grad_norm, u.tokens, self.cfg.algorithm.entropy_coef, lr)

    def _accumulate(self, u: Update) -> torch.Tensor:
        """Forward and backward of every pass of `u` (collective), gradients summed; returns the metric sums
        (`SUMS`, then the is-weight max) as a device tensor."""
        self.model.train()
        sums = torch.zeros(len(SUMS) + 1, dtype=torch.float64, device=self.device)  # SUMS, is-weight max
        for k, (mb, weight) in enumerate(u.passes()):
            if self.gather_once:  # reduce-scatter and reshard only after the step's last backward
                self.model.set_requires_gradient_sync(k == u.n_micro - 1)
                self.model.set_reshard_after_backward(k == u.n_micro - 1)
            got = self._micro_step(mb, weight, u.tokens, u.seqs)
            sums[:-1] += got[:-1]
            sums[-1] = torch.maximum(sums[-1], got[-1])
        return sums

    def backward_only(self, mbs: list[dict[str, Any]]) -> None:
        """The step's forward and backward passes over `mbs` (collective: the same on every rank), then the
        gradients dropped: no optimizer or scheduler step, the weights untouched (app/trainer/warm_up.py)."""
        tokens = float(sum(float(mb["mask"].sum()) for mb in mbs))
        seqs = float(sum(mb["mask"].shape[0] for mb in mbs))
        self._accumulate(Update(mbs=mbs, n_micro=len(mbs), filler=None, tokens=tokens, seqs=seqs))
        self.opt.zero_grad(set_to_none=True)

    def _plan(self, rows: list[Row]) -> tuple[list[list[Row]], int]:
        """This rank's micro-batches and the number of passes every rank runs."""
        t = self.cfg.train
        return split_rows(rows, self.rank, self.world, self.packed, t.micro_batch_tokens, t.micro_batch_size)

    def collate(self, rows: list[Row]) -> dict[str, Any]:
        """A micro-batch on the device: packed (`train.micro_batch_tokens > 0` on a packable model) or padded."""
        if self.packed:
            return collate_packed(rows, self.device, self.cfg.train.packed_attention)
        return collate(rows, self.pad_id, self.device)

    def logprobs(
        self,
        model: torch.nn.Module,
        mb: dict[str, Any],
        with_entropy: bool = False,
        entropy_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token log-probs (and entropy: with a gradient only with `entropy_grad`) on the micro-batch's grid."""
        chunk = self.cfg.train.logprob_chunk_tokens
        return micro_logprobs(model, mb, chunk, self.reference_path, with_entropy, entropy_grad)

    def _micro_step(
        self, mb: dict[str, Any], weight: float, num_tokens: float, num_seqs: float
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its metric sums (see `SUMS`) and is-weight max,
        as a device tensor."""
        a = self.cfg.algorithm
        bonus = a.entropy_coef > 0
        logp, ent = self.logprobs(self.model, mb, self.cfg.train.log_entropy or bonus, entropy_grad=bonus)
        prox = mb.get("prox")
        behaviour = mb["old"] if self.engine_behaviour else stand_in_behaviour(logp, prox)
        inp = LossInputs(
            logprobs=logp,
            behaviour_logprobs=behaviour,
            advantages=mb["adv"],
            mask=mb["mask"],
            proximal_logprobs=prox,
        )
        out = self.loss_fn(inp, a)
        loss_tok = out.loss_tok
        if a.kl_coef > 0:
            kl_tok = grpo.kl_penalty(logp, self._ref_logprobs(mb), a.kl_kind, a.max_log_ratio) * mb["mask"]
            loss_tok = loss_tok + a.kl_coef * kl_tok
        else:
            kl_tok = torch.zeros_like(out.loss_tok)
        if bonus:
            loss_tok = loss_tok - a.entropy_coef * ent * mb["mask"]
        loss = grpo.aggregate(loss_tok, mb["mask"], a.loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)
        # FSDP averages gradients over ranks; the denominators above are global, so scale back up
        (loss * self.world * weight).backward()
        return micro_sums(inp, out, kl_tok, ent, weight)

    def _ref_logprobs(self, mb: dict[str, Any]) -> torch.Tensor:
        if self.lora is not None:  # the base: the policy with its adapters off
            with torch.no_grad(), lora.disabled(self.model):
                return self.logprobs(self.model, mb)[0]
        if self.ref is not None:
            with torch.no_grad():
                return self.logprobs(self.ref, mb)[0]
        if "ref" in mb:
            return mb["ref"]
        raise RuntimeError(
            "algorithm.kl_coef > 0 with ref.workers > 0, but a trained sample has no reference "
            "log-probs (the reference workers did not score it)"
        )

    def _optimizer_step(self) -> float:
        """Clip, step (unless the gradient is non-finite) and zero; returns the gradient norm."""
        grad_norm = torch.nn.utils.clip_grad_norm_(
            lora.trainable_params(self.model), self.cfg.train.grad_clip
        )
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        if math.isfinite(grad_norm):  # a non-finite step changes nothing, the schedule included
            self.opt.step()
            self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return grad_norm

    # ------------------------------------------------------------ weights out

    def named_params(self) -> dict[str, torch.Tensor]:
        return {param_name(n): p for n, p in self.model.named_parameters()}

    def push_specs(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, shape, dtype) of every pushed tensor: every parameter, or with LoRA the adapters alone
        (`...q_proj.lora_A.weight`; the replica adds PEFT's `base_model.model.` prefix)."""
        dtype = self.cfg.model.dtype
        pushed = self.named_params().items()
        if self.lora is not None:
            pushed = [(n, p) for n, p in pushed if lora.is_adapter_param(n)]
        return [(n, tuple(p.shape), dtype) for n, p in pushed]

    def gather(self, names: list[str], cast: bool = True) -> list[torch.Tensor]:
        """Full tensors for `names` (an FSDP2 all-gather per parameter: every rank calls this in lock-step), in
        the model's dtype (`cast=False`: as the trainer holds them; a push's pack casts while it copies).

        The name -> parameter map is built once (a push calls this once per bucket; FSDP2 keeps its parameter
        objects for the model's life and updates them in place): rebuilding it per bucket was most of a 1.5B
        push's 23 ms gather on an H200. On several ranks the dim-0 shards of all `names` come in one all-gather
        (app/trainer/push_gather.py `gather_params`), in the model's dtype."""
        params = getattr(self, "_push_params", None)
        if params is None:
            params = self._push_params = self.named_params()
        return gather_params(params, names, getattr(torch, self.cfg.model.dtype), cast)

    def logprobs_of(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        """The trainer's log-probs for a fixed completion (collective: call on every rank)."""
        row = Row(prompt_ids, completion_ids, [0.0] * len(completion_ids), 0.0, [])
        mb = self.collate([row])
        self.model.eval()
        with torch.no_grad():
            logp, _ = self.logprobs(self.model, mb)
        if self.gather_once:  # without a backward the layers stay gathered (no reshard after forward):
            reshard(self.model)  # free them now rather than hold them until the next step ends
        return row_values(mb, logp, 0, row)

    def save_hf(self, path: str, tokenizer_path: str) -> None:
        """Full HF checkpoint (model + tokenizer) that vLLM can load, in `model.dtype` (the replicas' dtype;
        the trainer keeps float32 master weights); collective, rank 0 writes. With LoRA: the adapter in PEFT
        format and the tokenizer, plus the merged model in `merged/` with `model.lora.merge`
        (app/trainer/hf_export.py)."""
        m = self.cfg.model
        export_hf(self.model, path, tokenizer_path, self.rank, m.dtype, self.lora, m.lora.merge)
