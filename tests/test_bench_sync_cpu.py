"""bench/sync_bandwidth.py runs on CPU over gloo (a tiny Qwen2-shaped state) and ends with its JSON line;
plus the properties the push relies on from app.weights.buckets.checksum."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from app.weights.buckets import checksum

ROOT = Path(__file__).resolve().parent.parent


def test_sync_bandwidth_bench_cpu_json():
    cmd = [sys.executable, str(ROOT / "bench" / "sync_bandwidth.py"), "--cpu", "--sizes", "tiny"]
    cmd += ["--reps", "2", "--warmup", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["bench"] == "sync_bandwidth" and summary["backend"] == "gloo"
    tiny = summary["results"]["tiny"]
    assert tiny["nbytes"] > 0 and tiny["raw_ms"] > 0
    for var in ("current", "nockpt", "legacy"):
        row = tiny[var]
        assert row["push_ms"] > 0 and row["ratio_to_raw"] > 0 and row["verified"] is True
        assert set(row["sender_ms"]) == {"gather", "pack", "transfer"}
        assert set(row["receiver_ms"]) == {"recv_transfer", "load"}
    assert summary["ratios"]["tiny"] == round(tiny["current"]["ratio_to_raw"], 3)
    assert set(tiny["profile_ms"]) == {"pack_only", "checksum", "legacy_checksum"}


def test_checksum_is_content_defined_and_position_sensitive():
    g = torch.Generator().manual_seed(0)
    for n in (0, 1, 3, 7, 8, 4095, 4096 * 8, 4096 * 8 + 5, 100003):
        x = torch.randn(n + 3, generator=g).to(torch.bfloat16)
        v = x[3:]  # a view whose bytes are not 8-byte aligned
        assert checksum(v) == checksum(v.clone()), n
        if n > 2:
            flipped = v.clone()
            flipped.view(torch.int16)[n // 2] ^= 1
            assert checksum(flipped) != checksum(v), n
    x = torch.randn(4096 * 4 * 4, generator=g)  # 4 rows of 4096 int64 words
    w = x.view(torch.int64)
    for i, j in ((0, 1), (0, 4096), (5, 4096 * 3 + 9)):  # same row, same column, neither
        y = x.clone()
        y.view(torch.int64)[i], y.view(torch.int64)[j] = w[j], w[i]
        assert checksum(y) != checksum(x), (i, j)
