"""`torch.compile` where it pays in the trainer: the memory-bound parts of each decoder layer.

A transformer layer of a small model spends much of its time outside the matmuls: RMSNorm upcasts to float32
and runs five elementwise kernels (each a pass over the activations, each saving a tensor for backward), and
the SwiGLU MLP runs `silu` and the product as separate kernels over the widest activations of the layer. Here
those two pieces are pure functions compiled once (dynamic token dimensions, so one graph serves every
micro-batch length and every layer), and the model's RMSNorm and MLP modules are pointed at them.

Attention, the rotary embedding and FSDP2's hooks stay eager: the compiled regions take tensors only, so no
guard depends on a module, a parameter's identity or a packed micro-batch's boundaries, and FSDP2's gathered
parameters are read at call time. The numbers are the eager modules' (same operations, same dtypes), which
tests/test_packed_step.py checks on CPU in float32.
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


def compile_layers(model: torch.nn.Module, backend: str = "inductor") -> int:
    """Point `model`'s RMSNorm and SwiGLU MLP modules at compiled functions; returns how many were replaced.

    Call before FSDP2 wraps the model (the replaced `forward`s read their parameters at call time, so they see
    FSDP2's gathered parameters). Modules of other shapes keep their own forward.
    """
    n = 0
    for m in model.modules():
        if _is_rms_norm(m):
            m.forward = types.MethodType(_norm_forward, m)
        elif _is_swiglu(m):
            m.forward = types.MethodType(_mlp_forward, m)
        else:
            continue
        m.relay_compile_backend = backend
        n += 1
    log.info("compiled RMSNorm/SwiGLU forward of %d modules (backend %s)", n, backend)
    return n
