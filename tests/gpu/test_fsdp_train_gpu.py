"""FSDP2 GRPO training over NCCL on 2 GPUs: bf16 compute, fp32 gradient reduction, loss goes down on a fixed
batch, and the HF checkpoint written by `Learner.save_hf` loads back with equal weights."""

from __future__ import annotations

import math

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("the GPU tier needs 2 CUDA GPUs", allow_module_level=True)

import relay_gpu_helpers as h

pytestmark = pytest.mark.gpu


def test_fsdp2_grpo_steps_and_checkpoint(tmp_path):
    model_dir = h.build_model_dir(tmp_path / "init")
    ckpt = tmp_path / "ckpt"
    port = h.free_port()
    steps = 6
    reports = h.run_children(
        [(h.train_rank, (r, 2, port, model_dir, str(ckpt), steps)) for r in range(2)], tmp_path, 300
    )
    for r, rep in enumerate(reports):
        assert rep["ok"] and rep["exitcode"] == 0, f"rank {r}: {rep.get('error')}"
    r0, r1 = reports[0]["result"], reports[1]["result"]
    print("losses", r0["losses"], "grad norms", r0["grad_norms"])

    # mixed precision: bf16 parameters in compute, fp32 sharded master weights, fp32 gradient reduction
    assert r0["mp_param_dtype"] == "torch.bfloat16" and r0["mp_reduce_dtype"] == "torch.float32"
    assert r0["group_reduce_dtype"] == "torch.float32"
    assert r0["compute_weight_dtype"] == "torch.bfloat16" and r0["compute_input_dtype"] == "torch.bfloat16"
    assert r0["sharded_param_dtype"] == "torch.float32"

    # the same metrics on both ranks (they are all-reduced), finite, and the loss goes down
    assert r0["losses"] == pytest.approx(r1["losses"], rel=1e-6, abs=1e-9)
    assert r0["skipped"] == 0 and all(math.isfinite(g) and g > 0 for g in r0["grad_norms"])
    losses = r0["losses"]
    assert losses[-1] < losses[0] - 0.05, losses
    assert min(losses[1:]) < losses[0]

    # the checkpoint: every tensor present and bit-equal after from_pretrained, weights moved from init
    assert r0["ckpt_tensors"] > 0 and not r0["ckpt_missing"], r0["ckpt_missing"]
    assert not r0["ckpt_unequal"], r0["ckpt_unequal"]
    assert r0["ckpt_dtype"] == "torch.bfloat16"  # exported in model.dtype, not the float32 master weights
    assert r0["changed_vs_init"] > 0
    assert r0["tokenizer_vocab"] > 0
