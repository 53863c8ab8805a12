"""Building the trainer's model: an HF causal LM loaded and sharded with FSDP2 (optionally with LoRA adapters,
packed attention and compiled layers), and the parameter names vLLM's loader expects."""

from __future__ import annotations

import logging
import types
from typing import Any

import torch
import torch.distributed as dist

from app.trainer import lora
from app.trainer.logprobs import scored_forward

log = logging.getLogger(__name__)


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
    The model gets a `relay_scored_logprobs` method (app/trainer/logprobs.py `scored_logprobs`), registered
    as an FSDP2 forward method so that the root's parameters (embedding, final norm, output embedding) are
    gathered while it runs.
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
    model.relay_scored_logprobs = types.MethodType(scored_forward, model)
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


def reshard(model: torch.nn.Module) -> None:
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
