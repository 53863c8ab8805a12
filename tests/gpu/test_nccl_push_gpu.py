"""The NCCL weight push of app/sync.py between processes on two GPUs: trainer on GPU0, receiver on GPU1.

A push is complete only when the receiver acknowledged (version, checksums) on the control channel (a
multiprocessing queue here, the WeightHub in the real system) within the deadline. The failure tests kill a
receiver mid-push ("die") or leave one that joined the group but never takes part in the broadcast ("stuck";
"stuck_alive" keeps it alive while the group is formed again without it): the push must fail within its
deadline naming that receiver, and the same trainer process must push again once the group is formed anew.
"""

from __future__ import annotations

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("the GPU tier needs 2 CUDA GPUs", allow_module_level=True)

import relay_gpu_helpers as h

from app.weights.buckets import checksum

pytestmark = pytest.mark.gpu

TIMEOUT_S = 5.0  # the weight group's timeout: join, and each broadcast
DEADLINE_S = 12.0  # the whole push: transfer, load and acknowledgement


def _run_trainer(tmp_path, scenario, model_dir=None):
    (rep,) = h.run_children([(h.trainer_main, (scenario, model_dir, TIMEOUT_S, DEADLINE_S))], tmp_path, 150)
    assert rep["ok"] and rep["exitcode"] == 0, f"trainer process: {rep}"
    print(scenario, {k: v for k, v in rep["result"].items() if k != "events"})
    return rep["result"]["events"]


def _assert_healthy(ev, version):
    assert ev["what"] == "push" and ev["version"] == version and ev["acked_version"] == version
    assert ev["bucket_checksums_equal"], ev
    assert ev["param_checksums_equal"], "receiver holds other bytes than the trainer sent"
    assert ev["elapsed_s"] < DEADLINE_S


def test_checksum_agrees_on_cpu_and_gpu():
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 4096, 4096 * 8 + 3, 3 * 2**20 + 5):
        x = torch.randn(n + 3, generator=g).to(torch.bfloat16)
        for t in (x, x[3:], x[1:]):  # aligned and misaligned views
            assert checksum(t) == checksum(t.cuda()), n
    y = torch.randn(2**22, generator=g).to(torch.bfloat16).cuda()
    z = y.clone()
    z.view(torch.int16)[12345] ^= 1
    assert checksum(y) != checksum(z)


def test_push_mixed_state_bit_exact(tmp_path):
    events = _run_trainer(tmp_path, "mixed")
    assert len(events) == 2
    for ev, v in zip(events, (1, 2), strict=True):
        _assert_healthy(ev, v)
    assert events[0]["buckets"] >= 3
    changed = sum(
        events[0]["param_checksums"][n] != events[1]["param_checksums"][n]
        for n in events[0]["param_checksums"]
    )
    assert changed > 0


def test_push_from_one_rank_fsdp_trainer(tmp_path):
    model_dir = h.build_model_dir(tmp_path / "init")
    events = _run_trainer(tmp_path, "fsdp", model_dir)
    assert len(events) == 2
    for ev, v in zip(events, (1, 2), strict=True):
        _assert_healthy(ev, v)
    a, b = events[0]["param_checksums"], events[1]["param_checksums"]
    assert sum(a[n] != b[n] for n in a) > len(a) // 2  # one optimizer step moved the weights


@pytest.mark.parametrize("behaviour", ["die", "stuck", "stuck_alive"])
def test_push_failure_is_reported_and_trainer_recovers(tmp_path, behaviour):
    events = _run_trainer(tmp_path, behaviour)
    fail = events[0]
    assert fail["what"] == "failed_push" and fail["raised"], fail
    print(f"{behaviour}: failed after {fail['elapsed_s']:.1f}s: {fail['error']}")
    assert fail["rid"] in fail["error"] and "did not acknowledge" in fail["error"]
    assert fail["elapsed_s"] <= DEADLINE_S + 3.0
    # the same trainer process formed the group again with a fresh receiver and pushed twice
    _assert_healthy(events[1], 1)
    _assert_healthy(events[2], 2)
