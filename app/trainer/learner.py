"""Training: GRPO on a model sharded with FSDP2, run by Ray Train's TorchTrainer.

`Learner` holds the sharded policy (and, with a KL penalty, a frozen sharded reference) and does one
optimizer step on a `Batch` with the loss `algorithm.correction` picks from `app.trainer.losses.LOSSES`; it needs
torch alone (the GPU tier runs it without Ray). The per-worker loop around it is app/train_loop.py.
"""

from __future__ import annotations

import logging
import math
import time
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from app.plugins import resolve
from app.records import Batch, Group
from app.rollout.episode import env_metrics
from app.trainer import grpo, lora
from app.trainer.losses import LOSSES, LossInputs
from app.trainer.minibatch import merge_updates, mini_batches
from app.trainer.packing import (
    collate_packed,
    packed_model_kwargs,
    packing_enabled,
    plan_micro_batches,
    to_device,
)
from app.trainer.push_gather import gather_sharded

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- model building


def build_fsdp_model(
    path: str,
    dtype: str,
    device: torch.device,
    activation_checkpointing: bool = False,
    train: bool = True,
    *,
    packed: bool = False,
    reshard_after_forward: bool = True,
    reduce_dtype: str = "float32",
    compile_layers: bool = False,
    adapters: lora.LoraSpec | None = None,
) -> torch.nn.Module:
    """Load an HF causal LM and shard it with FSDP2: one `fully_shard` per decoder layer, then the root.

    Parameters are kept in float32; with `dtype=bfloat16` compute runs in bf16 and gradients are reduced in
    `reduce_dtype`. `packed` routes attention through app/trainer/packing.py (packed micro-batches); `compile_layers`
    compiles the layers' RMSNorm and MLP (app/trainer/compiled.py). `adapters` (LoRA) wraps the targeted linear
    layers before sharding (app/trainer/lora.py): the base is frozen in `dtype`, the adapters train in float32.
    The model gets
    a `relay_scored_logprobs` method (see `scored_logprobs`), registered as an FSDP2 forward method so that
    the root's parameters (embedding, final norm, output embedding) are gathered while it runs.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    if adapters is not None:
        _freeze_with_adapters(model, adapters, dtype)
    if packed:
        from app.trainer.packing import enable_packed_attention

        enable_packed_attention(model)
    if compile_layers:
        from app.trainer.compiled import compile_layers as compile_norms_and_mlps

        compile_norms_and_mlps(model)
        model.relay_compiled = True  # the chunked log-probs too (grpo.chunked_token_logprobs(fused=True))
    if activation_checkpointing and train:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.relay_scored_logprobs = types.MethodType(_scored_forward, model)
    mp = None
    if dtype == "bfloat16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=getattr(torch, reduce_dtype))
    kw: dict[str, Any] = {"mp_policy": mp} if mp is not None else {}
    if dist.is_initialized():
        from torch.distributed.device_mesh import init_device_mesh

        # the mesh on the configured device type: FSDP2's default mesh is CUDA whenever a GPU is visible
        kw["mesh"] = init_device_mesh(device.type, (dist.get_world_size(),))
        for layer in _decoder_layers(model):
            fully_shard(layer, reshard_after_forward=reshard_after_forward, **kw)
        fully_shard(model, **kw)
        register_fsdp_forward_method(model, "relay_scored_logprobs")
    if not train:
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
    return model


def _freeze_with_adapters(model: torch.nn.Module, spec: lora.LoraSpec, dtype: str) -> None:
    """LoRA: adapters on `spec.targets`, the base frozen and stored in the model dtype (no optimizer state,
    no gradient; FSDP2 wants one dtype among the trainable parameters of a group only)."""
    adapted = lora.apply_lora(model, spec)
    base_dtype = getattr(torch, dtype)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if not lora.is_adapter_param(n):
                p.data = p.data.to(base_dtype)
    n_train = sum(p.numel() for p in lora.trainable_params(model))
    log.info(
        "LoRA r=%d alpha=%g on %d layers (%s): %d trainable parameters of %d",
        spec.rank,
        spec.alpha,
        len(adapted),
        ",".join(spec.targets),
        n_train,
        sum(p.numel() for p in model.parameters()),
    )


def _dim0_sharded(p: Any) -> bool:
    """An FSDP2 parameter sharded on dim 0 over a 1-D mesh of several ranks (what push_gather.py gathers)."""
    placements = getattr(p, "placements", None)
    if not placements or len(placements) != 1 or p.device_mesh.ndim != 1 or p.device_mesh.size() < 2:
        return False
    from torch.distributed.tensor import Shard

    return isinstance(placements[0], Shard) and placements[0].dim == 0


def _reshard(model: torch.nn.Module) -> None:
    """Free every FSDP2 module's gathered parameters (no-op for modules that are sharded already)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers at model.model.layers to shard")
    return list(layers)


def param_name(name: str) -> str:
    """HF parameter name as vLLM's loader expects it (wrappers removed)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_fsdp_wrapped_module.", "")


# ---------------------------------------------------------------- batches to tensors


@dataclass
class Row:
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    advantage: float
    versions: list[int]
    ref_logprobs: list[float] | None = None  # from the reference workers (ref.workers > 0)
    loss_mask: list[int] | None = None  # 0 on environment tokens of a multi-turn trajectory

    def mask(self) -> torch.Tensor:
        """1 on the response tokens the loss sees (model tokens), 0 on environment tokens."""
        if self.loss_mask is None:
            return torch.ones(len(self.response_ids), dtype=torch.float32)
        return torch.tensor(self.loss_mask, dtype=torch.float32)

    @property
    def loss_tokens(self) -> int:
        return len(self.response_ids) if self.loss_mask is None else int(sum(self.loss_mask))


def flatten_batch(batch: Batch, normalize_std: bool) -> list[Row]:
    """GRPO advantages per group, then one row per sample (groups kept in order)."""
    rows: list[Row] = []
    for g in batch.groups:
        rewards = torch.tensor([[s.reward for s in g.samples]], dtype=torch.float32)
        adv = grpo.group_advantages(rewards, normalize_std=normalize_std)[0].tolist()
        for s, a in zip(g.samples, adv, strict=True):
            if not s.token_ids:
                continue
            rows.append(
                Row(g.prompt_ids, s.token_ids, s.logprobs, a, s.versions, s.ref_logprobs, s.loss_mask)
            )
    return rows


def collate(rows: list[Row], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded input ids plus response-aligned targets: position t predicts token t+1.

    Grids (`targets`, `mask`, `old`, `adv`, `ref`) are ``[B, W-1]``; `score_idx`, `score_targets` and
    `grid_idx` list the response positions for `scored_logprobs` (flat indices into the ``[B, W]`` hidden
    states and into the grid).
    """
    width = max(len(r.prompt_ids) + len(r.response_ids) for r in rows)
    b = len(rows)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    targets = torch.zeros((b, width - 1), dtype=torch.long)
    mask = torch.zeros((b, width - 1), dtype=torch.float32)
    old = torch.zeros((b, width - 1), dtype=torch.float32)
    adv = torch.zeros((b, width - 1), dtype=torch.float32)
    has_ref = bool(rows) and all(r.ref_logprobs is not None for r in rows)
    ref = torch.zeros((b, width - 1), dtype=torch.float32)
    resp = torch.zeros((b, width - 1), dtype=torch.bool)  # every response position (scored)
    for i, r in enumerate(rows):
        seq = list(r.prompt_ids) + list(r.response_ids)
        n, p = len(seq), len(r.prompt_ids)
        ids[i, :n] = torch.tensor(seq)
        attn[i, :n] = 1
        targets[i, : n - 1] = torch.tensor(seq[1:])
        sl = slice(p - 1, n - 1)
        mask[i, sl] = r.mask()
        resp[i, sl] = True
        old[i, sl] = torch.tensor(r.behaviour_logprobs, dtype=torch.float32)
        adv[i, sl] = r.advantage
        if has_ref:
            ref[i, sl] = torch.tensor(r.ref_logprobs, dtype=torch.float32)
    grid_idx = resp.flatten().nonzero().squeeze(1)  # b * (W-1) + t, on the host
    out = dict(input_ids=ids, attention_mask=attn, targets=targets, mask=mask, old=old, adv=adv)
    out.update(score_idx=grid_idx + grid_idx // (width - 1), score_targets=targets.flatten()[grid_idx])
    out["grid_idx"] = grid_idx
    if has_ref:
        out["ref"] = ref
    return to_device(out, device)


def response_logprobs(
    model: torch.nn.Module, mb: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference path: full float32 logits of a padded micro-batch, then `grpo.token_logprobs`."""
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits[:, :-1].float()
    return grpo.token_logprobs(logits, mb["targets"]), logits


def _scored_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    score_idx: torch.Tensor,
    score_targets: torch.Tensor,
    chunk_tokens: int,
    with_entropy: bool,
    entropy_grad: bool = False,
    **model_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Base model forward, then the output head on the scored positions only, chunked (no full logits).

    Bound to the model as `relay_scored_logprobs` (an FSDP2 forward method: the output embedding, tied or
    not, is gathered while it runs and its gradient reduced like any other).
    """
    hidden = model.base_model(input_ids=input_ids, **model_kwargs).last_hidden_state
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, score_idx)
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise NotImplementedError("chunked log-probs assume an output embedding without bias")
    fused = getattr(model, "relay_compiled", False)
    return grpo.chunked_token_logprobs(
        h, head.weight, score_targets, chunk_tokens, with_entropy, fused, entropy_grad
    )


def scored_logprobs(
    model: torch.nn.Module,
    mb: dict[str, Any],
    chunk_tokens: int,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token log-probs (and entropy, with a gradient only with `entropy_grad`) of a micro-batch's response
    tokens, laid out on its grid (`mb["mask"]`'s shape; 0 elsewhere). Works on padded (`collate`) and packed
    (`app.trainer.packing.collate_packed`) micro-batches, on FSDP2 models from `build_fsdp_model` and on plain
    HF models."""
    kw = packed_model_kwargs(mb) if "packed" in mb else {"attention_mask": mb["attention_mask"]}
    fwd = getattr(model, "relay_scored_logprobs", None) or types.MethodType(_scored_forward, model)
    ids, idx, tgt = mb["input_ids"], mb["score_idx"], mb["score_targets"]
    logp, ent = fwd(ids, idx, tgt, chunk_tokens, with_entropy, entropy_grad, **kw)
    mask = mb["mask"]

    def grid(v: torch.Tensor) -> torch.Tensor:
        return (
            torch.zeros(mask.numel(), dtype=v.dtype, device=v.device)
            .index_copy(0, mb["grid_idx"], v)
            .view_as(mask)
        )

    return grid(logp), (grid(ent) if ent is not None else None)


def row_values(mb: dict[str, Any], grid: torch.Tensor, i: int, row: Row) -> list[float]:
    """Row `i`'s response values (one per response token) from a grid of `collate` or `collate_packed`."""
    n = len(row.response_ids)
    start = 0 if "packed" in mb else len(row.prompt_ids) - 1
    return grid[i, start : start + n].tolist()


# ---------------------------------------------------------------- the learner

# token-weighted sums a step accumulates over micro-batches (then divided by the token count)
_SUMS = ("loss", "kl", "entropy", "clipped", "tokens", "mismatch", "is_weight", "ppo_kl")


def stand_in_behaviour(logprobs: torch.Tensor, proximal: torch.Tensor | None) -> torch.Tensor:
    """`rollout.behaviour_logprobs=trainer`: the behaviour log-probs are the trainer's at the step's start, the
    proximal pass's where a batch takes several optimizer steps, else this forward's (detached, no extra
    pass). The ratio to them is then PPO's trust region alone (1 at a batch's first step)."""
    return (logprobs if proximal is None else proximal).detach()


@dataclass
class _Update:
    """One optimizer step's micro-batches on this rank, on the device. `n_micro` passes run on every rank;
    past its own micro-batches a rank runs zero-weight passes on `filler`. `tokens` and `seqs` count the
    whole update's (every rank's) loss tokens and sequences: the loss's global denominators."""

    mbs: list[dict[str, Any]]
    n_micro: int
    filler: dict[str, Any] | None
    tokens: float
    seqs: float

    def passes(self) -> list[tuple[dict[str, Any], float]]:
        """(micro-batch, weight) of each pass, in order."""
        return [(self.mbs[k], 1.0) if k < len(self.mbs) else (self.filler, 0.0) for k in range(self.n_micro)]


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
        self.lora = lora.LoraSpec.from_config(cfg.model)  # None: full fine-tuning
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

    def _layout(self, batch: Batch) -> _Update:
        """One update's micro-batches on this rank, laid out and copied to the device up front."""
        rows = flatten_batch(batch, self.cfg.algorithm.normalize_adv_std)
        parts, n_micro = self._plan(rows)
        mbs = [self.collate(p) for p in parts]
        filler = None
        if len(mbs) < n_micro:
            pool = [r for p in parts for r in p] or rows
            filler = self.collate([min(pool, key=lambda r: len(r.prompt_ids) + len(r.response_ids))])
        tokens = float(sum(r.loss_tokens for r in rows))
        return _Update(mbs=mbs, n_micro=n_micro, filler=filler, tokens=tokens, seqs=float(len(rows)))

    def _proximal(self, ups: list[_Update]) -> None:
        """The trainer's own log-probs of every micro-batch before the batch's first update (`mb["prox"]`),
        in the updates' mode and without gradient. Every rank runs as many passes as in an update (FSDP2)."""
        self.model.train()
        with torch.no_grad():
            for u in ups:
                for mb, _ in u.passes():
                    mb["prox"] = self.logprobs(self.model, mb)[0]
        if self.gather_once:  # without a backward the layers stay gathered: free them before the updates
            _reshard(self.model)

    def _update(self, u: _Update) -> dict[str, float]:
        """One optimizer step on an update's micro-batches (collective).

        Every rank runs the same number of forward/backward passes (FSDP2 collectives): a rank with fewer
        micro-batches runs zero-weight passes on a copy of one row. Metric sums stay on the device until the
        step ends (no host synchronisation inside the micro-batch loop).
        """
        self.model.train()
        sums = torch.zeros(len(_SUMS) + 1, dtype=torch.float64, device=self.device)  # _SUMS, is-weight max
        for k, (mb, weight) in enumerate(u.passes()):
            if self.gather_once:  # reduce-scatter and reshard only after the step's last backward
                self.model.set_requires_gradient_sync(k == u.n_micro - 1)
                self.model.set_reshard_after_backward(k == u.n_micro - 1)
            got = self._micro_step(mb, weight, u.tokens, u.seqs)
            sums[:-1] += got[:-1]
            sums[-1] = torch.maximum(sums[-1], got[-1])
        grad_norm = self._optimizer_step()
        return self._step_metrics(self._reduce(sums), grad_norm, u.tokens)

    def _plan(self, rows: list[Row]) -> tuple[list[list[Row]], int]:
        """This rank's micro-batches and the number of passes every rank runs."""
        t = self.cfg.train
        if self.packed:
            lengths = [len(r.prompt_ids) + len(r.response_ids) for r in rows]
            plan = plan_micro_batches(lengths, self.world, t.micro_batch_tokens, t.micro_batch_size)
            n_micro = max(1, max(len(p) for p in plan))
            return [[rows[i] for i in mb] for mb in plan[self.rank]], n_micro
        mine = rows[self.rank :: self.world]
        most = math.ceil(len(rows) / self.world)  # the largest rank's share: the same on every rank
        mbs = t.micro_batch_size or max(1, most)  # 0: a rank's whole share in one pass
        n_micro = max(1, math.ceil(most / mbs))
        return [
            mine[k * mbs : (k + 1) * mbs] for k in range(n_micro) if mine[k * mbs : (k + 1) * mbs]
        ], n_micro

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
        if not self.reference_path:
            chunk = self.cfg.train.logprob_chunk_tokens
            return scored_logprobs(model, mb, chunk, with_entropy, entropy_grad)
        logp, logits = response_logprobs(model, mb)
        ent = None
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                ent = grpo.entropy_from_logits(logits)
        return logp, ent

    def _micro_step(
        self, mb: dict[str, Any], weight: float, num_tokens: float, num_seqs: float
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its metric sums (see _SUMS) and is-weight max,
        as a device tensor."""
        a = self.cfg.algorithm
        bonus = a.entropy_coef > 0
        logp, ent = self.logprobs(self.model, mb, self.cfg.train.log_entropy or bonus, entropy_grad=bonus)
        prox = mb.get("prox")
        behaviour = mb["old"] if self.engine_behaviour else stand_in_behaviour(logp, prox)
        out = self.loss_fn(
            LossInputs(
                logprobs=logp,
                behaviour_logprobs=behaviour,
                advantages=mb["adv"],
                mask=mb["mask"],
                proximal_logprobs=prox,
            ),
            a,
        )
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
        with torch.no_grad():
            m = mb["mask"] * weight
            ent = torch.zeros_like(m) if ent is None else ent.detach()
            drift = torch.zeros_like(m) if prox is None else prox - logp.detach()
            per_tok = (out.loss_tok, kl_tok, ent, out.clipped.float(), torch.ones_like(m))
            per_tok += ((logp - behaviour).abs(), out.is_weight, drift)
            vals = torch.stack([(x * m).sum() for x in per_tok])
            w_max = torch.where(m > 0, out.is_weight, torch.zeros_like(m)).max()  # weights are >= 0
            return torch.cat([vals, w_max[None]]).double()

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

    def _reduce(self, sums: torch.Tensor) -> torch.Tensor:
        """Sums over ranks (the last entry, the is-weight max, is a max), read back to the host once."""
        if dist.is_initialized():
            red, mx = sums[:-1].clone(), sums[-1:].clone()
            dist.all_reduce(red)
            dist.all_reduce(mx, op=dist.ReduceOp.MAX)
            sums = torch.cat([red, mx])
        return sums.cpu()

    def _step_metrics(self, sums: torch.Tensor, grad_norm: float, total_tokens: float) -> dict[str, float]:
        s = dict(zip(_SUMS, sums.tolist(), strict=False))
        tok = max(1.0, s["tokens"])
        coef = self.cfg.algorithm.entropy_coef
        bonus = {"loss/entropy_bonus": -coef * s["entropy"] / tok} if coef > 0 else {}
        return {
            **bonus,
            "loss/policy": s["loss"] / tok,
            "loss/kl": s["kl"] / tok,
            "actor/entropy": s["entropy"] / tok,
            "actor/clip_frac": s["clipped"] / tok,
            "actor/grad_norm": grad_norm,
            "actor/logprob_mismatch": s["mismatch"] / tok,
            "actor/is_weight_mean": s["is_weight"] / tok,
            "actor/is_weight_max": float(sums[-1]),
            "actor/ppo_kl": s["ppo_kl"] / tok,
            "actor/lr": self.sched.get_last_lr()[0],
            "train/skipped_steps": 0.0 if math.isfinite(grad_norm) else 1.0,
            "train/tokens": total_tokens,
        }

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
        push's 23 ms gather on an H200. Under no_grad a DTensor's `to_local()` is its local tensor, with no
        dispatch (a `detach()` first went through DTensor's dispatcher for every tensor). On several ranks the
        dim-0 shards of all `names` come in one all-gather (app/trainer/push_gather.py), in the model's dtype."""
        params = getattr(self, "_push_params", None)
        if params is None:
            params = self._push_params = self.named_params()
        dtype = getattr(torch, self.cfg.model.dtype)
        out: dict[str, torch.Tensor] = {}
        sharded = [n for n in names if _dim0_sharded(params[n])]
        sharded = [n for n in sharded if params[n].device_mesh == params[sharded[0]].device_mesh]
        with torch.no_grad():
            if sharded:  # one all-gather for all of them (push_gather.py), already in the pushed dtype
                mesh = params[sharded[0]].device_mesh
                full = gather_sharded(
                    [params[n].to_local() for n in sharded],
                    [tuple(params[n].shape) for n in sharded],
                    mesh.size(),
                    dtype,
                    lambda o, i: dist.all_gather_into_tensor(o, i, group=mesh.get_group()),
                )
                out.update(zip(sharded, full, strict=True))
            for n in names:
                if n in out:
                    continue
                p = params[n]
                if not hasattr(p, "full_tensor"):
                    t = p.detach()
                elif p.device_mesh.size() == 1:  # one rank holds it whole: no all-gather
                    t = p.to_local()
                else:
                    t = p.full_tensor()
                out[n] = t.to(dtype) if cast else t
        return [out[n] for n in names]

    def logprobs_of(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        """The trainer's log-probs for a fixed completion (collective: call on every rank)."""
        row = Row(prompt_ids, completion_ids, [0.0] * len(completion_ids), 0.0, [])
        mb = self.collate([row])
        self.model.eval()
        with torch.no_grad():
            logp, _ = self.logprobs(self.model, mb)
        if self.gather_once:  # without a backward the layers stay gathered (no reshard after forward):
            _reshard(self.model)  # free them now rather than hold them until the next step ends
        return row_values(mb, logp, 0, row)

    def save_hf(self, path: str, tokenizer_path: str) -> None:
        """Full HF checkpoint (model + tokenizer) that vLLM can load, in `model.dtype` (the replicas' dtype;
        the trainer keeps float32 master weights); collective, rank 0 writes. With LoRA: the adapter in PEFT
        format and the tokenizer, plus the merged model in `merged/` with `model.lora_merge`
        (`save_adapter_export`)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from transformers import AutoTokenizer

        if dist.is_initialized():
            sd = get_model_state_dict(
                self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        else:
            sd = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        if self.rank == 0 and self.lora is not None:
            merge = self.cfg.model.dtype if self.cfg.model.lora_merge else None
            save_adapter_export(path, tokenizer_path, sd, self.lora, merge_dtype=merge)
        elif self.rank == 0:
            from transformers import AutoModelForCausalLM

            dtype = getattr(torch, self.cfg.model.dtype)
            cfg_model = AutoModelForCausalLM.from_pretrained(tokenizer_path, dtype=dtype)
            cfg_model.load_state_dict({param_name(k): v.to(dtype) for k, v in sd.items()})
            cfg_model.save_pretrained(path, safe_serialization=True)
            AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(path)


def save_adapter_export(
    path: str,
    base_path: str,
    state: dict[str, torch.Tensor],
    spec: lora.LoraSpec,
    merge_dtype: str | None = None,
) -> None:
    """LoRA's final export: `path` is a PEFT adapter folder (adapter_config.json, adapter_model.safetensors,
    the tokenizer) for `base_path`; with `merge_dtype`, `path/merged` is the base with the adapter merged in,
    in that dtype: a plain HF folder vLLM loads alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sd = {param_name(k): v for k, v in state.items()}
    lora.save_adapter(path, sd, spec, base_model=str(base_path))
    tok = AutoTokenizer.from_pretrained(base_path)
    tok.save_pretrained(path)
    if merge_dtype is not None:
        dtype = getattr(torch, merge_dtype)
        model = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype)
        model.load_state_dict({k: v.to(dtype) for k, v in lora.merged_state_dict(sd, spec).items()})
        model.save_pretrained(f"{path}/merged", safe_serialization=True)
        tok.save_pretrained(f"{path}/merged")


def staleness(batch: Batch, version: int) -> dict[str, float]:
    """Per-token staleness (the trainer's version minus the version that sampled the token), its mean by
    response-length decile (`staleness/len_decile_0` holds the shortest tenth), and how many groups span
    more than one version (partial rollouts)."""
    vals = [version - v for g in batch.groups for s in g.samples for v in s.versions]
    if not vals:
        return {"staleness/mean": 0.0, "staleness/max": 0.0}
    out = {"staleness/mean": sum(vals) / len(vals), "staleness/max": float(max(vals))}
    samples = [s for g in batch.groups for s in g.samples if s.versions]
    for i, m in enumerate(staleness_by_length_decile(samples, version)):
        out[f"staleness/len_decile_{i}"] = m
    spans = [g.max_version - g.min_version for g in batch.groups if g.samples]
    out["async/partial_ratio"] = sum(1 for x in spans if x > 0) / max(1, len(spans))
    out["async/max_version_span"] = float(max(spans, default=0))
    return out


def staleness_by_length_decile(samples: list, version: int) -> list[float]:
    """Mean per-token staleness of the samples in each response-length decile (shortest first).

    Samples are sorted by length and cut into ten equal-count slices (fewer when there are under ten
    samples); a slice's value is the mean over its tokens.
    """
    ordered = sorted(samples, key=lambda s: len(s.token_ids))
    n = len(ordered)
    k = min(10, n)
    out = []
    for i in range(k):
        part = ordered[i * n // k : (i + 1) * n // k]
        toks = [version - v for s in part for v in s.versions]
        out.append(sum(toks) / len(toks) if toks else 0.0)
    return out


def batch_metrics(batch: Batch) -> dict[str, float]:
    rewards = [s.reward for g in batch.groups for s in g.samples]
    lengths = [len(s.token_ids) for g in batch.groups for s in g.samples]
    n = max(1, len(rewards))
    mean = sum(rewards) / n
    std = (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5
    subs: dict[str, list[float]] = {}
    fns: dict[str, list[float]] = {}  # each reward function's score (reward.fns)
    for g in batch.groups:
        for s in g.samples:
            for k, v in s.reward_extras.items():
                subs.setdefault(k, []).append(v)
            for k, v in s.reward_scores.items():
                fns.setdefault(k, []).append(v)
    solved = sum(1 for g in batch.groups if all(s.reward > 0 for s in g.samples))
    zero = sum(1 for g in batch.groups if len({s.reward for s in g.samples}) == 1)
    return {
        "reward/mean": mean,
        "reward/std": std,
        "response/length_mean": sum(lengths) / n,
        "response/length_max": float(max(lengths, default=0)),
        "response/truncated_frac": sum(
            1 for g in batch.groups for s in g.samples if s.finish_reason == "length"
        )
        / n,
        "batch/groups_all_solved": float(solved),
        "batch/groups_zero_adv": float(zero),
        "data/dropped_overlong": float(batch.dropped_overlong),
        **{k: float(v) for k, v in batch.reward_errors.items()},
        **{f"reward/sub/{k}": sum(v) / len(v) for k, v in subs.items()},  # a reward's named sub-scores
        **{f"reward/{k}": sum(v) / len(v) for k, v in fns.items()},  # each function's of reward.fns
        **env_metrics([s for g in batch.groups for s in g.samples]),
    }


def group_ids(groups: list[Group]) -> list[str]:
    return [g.uid for g in groups]


def now() -> float:
    return time.perf_counter()
