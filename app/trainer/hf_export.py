"""The trained model's final export, a folder vLLM loads: a full HF checkpoint in the replicas' dtype, or with
LoRA a PEFT adapter folder (plus, with `model.lora.merge`, the base with the adapter merged in)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from app.trainer import lora
from app.trainer.model_build import param_name


def export_hf(
    model: torch.nn.Module,
    path: str,
    tokenizer_path: str,
    rank: int,
    dtype: str,
    adapters: lora.LoraSpec | None = None,
    lora_merge: bool = False,
) -> None:
    """Full HF checkpoint (model + tokenizer) that vLLM can load, in `dtype` (the replicas' dtype; the trainer
    keeps float32 master weights); collective, rank 0 writes. With `adapters` (LoRA): the adapter in PEFT
    format and the tokenizer, plus the merged model in `merged/` with `lora_merge` (`save_adapter_export`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoTokenizer

    if dist.is_initialized():
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if rank == 0 and adapters is not None:
        merge = dtype if lora_merge else None
        save_adapter_export(path, tokenizer_path, sd, adapters, merge_dtype=merge)
    elif rank == 0:
        from transformers import AutoModelForCausalLM

        torch_dtype = getattr(torch, dtype)
        cfg_model = AutoModelForCausalLM.from_pretrained(tokenizer_path, dtype=torch_dtype)
        cfg_model.load_state_dict({param_name(k): v.to(torch_dtype) for k, v in sd.items()})
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
