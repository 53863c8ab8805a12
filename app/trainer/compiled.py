"""`torch.compile` where it pays in the trainer: the memory-bound parts of each decoder layer.

A transformer layer of a small model spends much of its time outside the matmuls: RMSNorm upcasts to float32
and runs five elementwise kernels (each a pass over the activations, each saving a tensor for backward), the
SwiGLU MLP runs `silu` and the product as separate kernels over the widest activations of the layer, and the
rotary embedding slices, negates, concatenates and multiplies q and k (and its backward fills zeros and
copies slices). Here those pieces are pure functions compiled once (dynamic token dimensions, so one graph
serves every micro-batch length and every layer), and the model's RMSNorm, MLP and (for packed micro-batches)
attention modules are pointed at them.

The attention kernel itself (app/trainer/packing.py) and FSDP2's hooks stay eager: the compiled regions take tensors
only, so no guard depends on a module, a parameter's identity or a packed micro-batch's boundaries, and
FSDP2's gathered parameters are read at call time. The numbers are the eager modules' (same operations; in
bf16 the fused kernels round once where eager rounds after every operation), which tests/test_packed_step.py
checks on CPU in float32.
"""

from __future__ import annotations

import functools
import logging
import types
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Qwen2/Llama RMSNorm: normalise in float32, cast back, scale by the weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """HF's SwiGLU MLP without biases: ``down(silu(gate(x)) * up(x))``."""
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def qkv_rope(
    x: torch.Tensor,
    wq: torch.Tensor,
    bq: torch.Tensor | None,
    wk: torch.Tensor,
    bk: torch.Tensor | None,
    wv: torch.Tensor,
    bv: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v projections of ``x [B, T, H]`` with HF's rotary embedding on q and k (``cos``/``sin``
    ``[B, T, head_dim]``); each ``[B, T, heads, head_dim]``."""
    q, k, v = (F.linear(x, w, b).unflatten(-1, (-1, head_dim)) for w, b in ((wq, bq), (wk, bk), (wv, bv)))
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v


@functools.cache
def _compiled(fn: Any, backend: str) -> Any:
    return torch.compile(fn, backend=backend, dynamic=None)


def _mark_tokens_dynamic(x: torch.Tensor) -> None:
    # every dimension but the last (hidden) varies between micro-batches: trace them symbolic from the start
    for d in range(x.dim() - 1):
        torch._dynamo.maybe_mark_dynamic(x, d)


def _norm_forward(module: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    _mark_tokens_dynamic(hidden_states)
    fn = _compiled(rms_norm, module.relay_compile_backend)
    return fn(hidden_states, module.weight, module.variance_epsilon)


def _mlp_forward(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    _mark_tokens_dynamic(x)
    fn = _compiled(swiglu, module.relay_compile_backend)
    return fn(x, module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight)


def _attn_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: Any = None,
    past_key_values: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF's Qwen2/Llama attention forward for packed micro-batches, with q/k/v and the rotary embedding
    compiled; any other call (padded batches, a KV cache) runs the class's own forward."""
    packed = kwargs.get("relay_packed")
    cos, sin = position_embeddings
    if packed is None or past_key_values is not None or cos.dim() != 3:  # cos/sin [B, T, dim] only
        return type(module).forward(
            module, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs
        )
    from app.trainer.packing import packed_attention

    for t in (hidden_states, cos, sin):
        _mark_tokens_dynamic(t)
    q, k, v = _compiled(qkv_rope, module.relay_compile_backend)(
        hidden_states,
        *(t for proj in (module.q_proj, module.k_proj, module.v_proj) for t in (proj.weight, proj.bias)),
        cos,
        sin,
        module.head_dim,
    )
    # [B, T, heads, dim] -> the [B, heads, T, dim] views attention functions take (no copy)
    out, _ = packed_attention(
        module,
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        None,
        scaling=module.scaling,
        dropout=0.0 if not module.training else module.attention_dropout,
        sliding_window=getattr(module, "sliding_window", None),
        relay_packed=packed,
    )
    return module.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), None


def _is_rms_norm(m: torch.nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return (
        type(m).__name__.endswith("RMSNorm")
        and isinstance(w, torch.nn.Parameter)
        and w.dim() == 1
        and isinstance(getattr(m, "variance_epsilon", None), float)
    )


def _is_swiglu(m: torch.nn.Module) -> bool:
    projs = [getattr(m, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    hidden_act = getattr(getattr(m, "config", None), "hidden_act", None)
    return (
        all(isinstance(p, torch.nn.Linear) and p.bias is None for p in projs)
        and hidden_act == "silu"
        and type(m).__name__.endswith("MLP")
    )


def _is_plain_attention(m: torch.nn.Module) -> bool:
    """Qwen2/Llama-style attention: q/k/v/o linear projections, HF rotary embedding, no q/k norms."""
    projs = [getattr(m, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    return (
        type(m).__name__.endswith("Attention")
        and all(isinstance(p, torch.nn.Linear) for p in projs)
        and isinstance(getattr(m, "head_dim", None), int)
        and isinstance(getattr(m, "scaling", None), float)
        and getattr(m, "q_norm", None) is None
        and getattr(m, "k_norm", None) is None
    )


def compile_layers(model: torch.nn.Module, backend: str = "inductor") -> int:
    """Point `model`'s RMSNorm, SwiGLU MLP and attention modules at compiled functions; returns how many
    were replaced.

    Call before FSDP2 wraps the model (the replaced `forward`s read their parameters at call time, so they see
    FSDP2's gathered parameters). Modules of other shapes keep their own forward.
    """
    n = 0
    for m in model.modules():
        if _is_rms_norm(m):
            m.forward = types.MethodType(_norm_forward, m)
        elif _is_swiglu(m):
            m.forward = types.MethodType(_mlp_forward, m)
        elif _is_plain_attention(m):
            m.forward = types.MethodType(_attn_forward, m)
        else:
            continue
        m.relay_compile_backend = backend
        n += 1
    log.info("compiled RMSNorm/SwiGLU/attention forward of %d modules (backend %s)", n, backend)
    return n
