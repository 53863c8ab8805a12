"""A real run (`--config quick` on the shared cluster) whose reward fails on every sample stops within
`reward.fail_fast_samples` samples, its RESULT naming the function, the exception and the row, instead of
training on `reward.on_error` (the unit tests: tests/test_rewards_styles.py)."""

from __future__ import annotations

import json
import subprocess

from tests.integration.conftest import REPO, train_cmd


def test_a_run_whose_rewards_all_fail_stops_naming_the_first_error(ray_cluster, cache_dir, tmp_path):
    from app.tasks.tiny import ensure_builtin

    root = ensure_builtin(cache_dir)
    rows = [json.loads(line) for line in (root / "train.jsonl").read_text().splitlines() if line.strip()]
    # the first row's answer passes the check before Ray (called with it as the response); no model writes it
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [{**rows[0], "answer": "zzzz"}, *rows[1:]]) + "\n")
    cmd = train_cmd(
        ray_cluster,
        cache_dir,
        tmp_path,
        "reward-stop",
        f"data.train={data}",
        "reward.fn=tests.reward_styles_example:only_marker",
        "reward.fail_fast_samples=8",
        "train.workers=1",  # the run stops at its first batch's rewards: one trainer rank is enough
    )
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1, proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout[-2000:]
    res = json.loads(lines[0][len("RESULT ") :])
    assert res["ok"] is False
    for part in (
        "failed on all of the first 8 samples",
        "only_marker",
        "KeyError",
        "reference_solution",
        "row ",
    ):
        assert part in res["error"], res["error"]
