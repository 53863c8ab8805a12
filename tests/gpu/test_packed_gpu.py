"""Packed attention and chunked log-probs on one CUDA GPU in bf16: FlashAttention's varlen kernel (through
torch.nn.attention.varlen) against one causal sdpa call per sequence, and chunked log-probs against full
logits, forward and backward. Also runs as a script (`python tests/gpu/test_packed_gpu.py`)."""

from __future__ import annotations

import itertools

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from app.trainer import grpo
from app.trainer.packing import PackedSeqs, _varlen_fn, packed_attention

pytestmark = pytest.mark.gpu


def _qkv(lens: list[int], heads: int = 8, kv: int = 2, dim: int = 64):
    g = torch.Generator(device="cuda").manual_seed(0)
    t = sum(lens)

    def mk(h: int) -> torch.Tensor:
        return torch.randn(1, h, t, dim, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()

    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return mk(heads), mk(kv), mk(kv), cu


def test_varlen_matches_per_sequence_sdpa():
    assert _varlen_fn() is not None, "torch.nn.attention.varlen is missing"
    q, k, v, cu = _qkv([100, 7, 333, 64])
    outs, grads = [], []
    for mode in ("varlen", "per_seq"):
        p = PackedSeqs(
            torch.tensor(cu, dtype=torch.int32, device="cuda"),
            cu,
            max(b - a for a, b in itertools.pairwise(cu)),
            mode,
        )
        out, _ = packed_attention(torch.nn.Module(), q, k, v, None, scaling=64**-0.5, relay_packed=p)
        outs.append(out.float())
        grads.append(torch.autograd.grad(out.float().square().sum(), (q, k, v)))
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)
    for a, b in zip(grads[0], grads[1]):  # bf16 gradients: compare in norm
        assert (a.float() - b.float()).norm() <= 1e-2 * b.float().norm()


def test_chunked_logprobs_bf16_cuda():
    g = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(3000, 256, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(32000, 256, device="cuda", generator=g) * 0.05).bfloat16().requires_grad_()
    t = torch.randint(0, 32000, (3000,), device="cuda", generator=g)
    full = grpo.token_logprobs(h.float() @ w.float().t(), t)
    want = torch.autograd.grad(full.sum(), (h, w))
    logp, ent = grpo.chunked_token_logprobs(h, w, t, 1024, with_entropy=True)
    torch.testing.assert_close(logp, full, atol=2e-2, rtol=0)
    got = torch.autograd.grad(logp.sum(), (h, w))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    assert ent.shape == (3000,) and torch.isfinite(ent).all()


if __name__ == "__main__":
    import inspect

    print("torch", torch.__version__, "varlen", inspect.signature(_varlen_fn()) if _varlen_fn() else None)
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    try:
        print("mm out_dtype:", torch.mm(a, a, out_dtype=torch.float32).dtype)
    except Exception as e:
        print("mm out_dtype unsupported:", e)
    test_varlen_matches_per_sequence_sdpa()
    test_chunked_logprobs_bf16_cuda()
    print("gpu packed/chunked checks passed")
