"""bench/train_throughput.py runs on CPU over gloo (a tiny Qwen2 shape, world size 1) and ends with its JSON
line; in float32 the old and the new step train the same batch to the same loss."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_train_throughput_bench_cpu_json():
    cmd = [sys.executable, str(ROOT / "bench" / "train_throughput.py"), "--device", "cpu", "--sizes", "tiny"]
    cmd += [
        "--seq-lens",
        "8+24",
        "--tokens-per-step",
        "256",
        "--micro-tokens",
        "128",
        "--response-spread",
        "0.5",
    ]
    cmd += ["--variants", "padded_full,packed_chunked", "--steps", "1", "--warmup", "0"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["bench"] == "train_throughput" and summary["ok"] and summary["gpus"] == 1
    old, new = summary["results"]
    assert (old["variant"], new["variant"]) == ("padded_full", "packed_chunked")
    for row in (old, new):
        assert row["tokens_per_s"] > 0 and row["mfu"] > 0 and row["seq"] == "8+24"
    assert new["tokens_per_step"] == old["tokens_per_step"]
    assert new["loss"] == pytest.approx(old["loss"], abs=1e-5)
    assert new["grad_norm"] == pytest.approx(old["grad_norm"], rel=1e-4)
