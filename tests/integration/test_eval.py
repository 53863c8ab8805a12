"""`python -m app eval` on the embedded model's final checkpoint (of test_async.py's keep-mode run, shared), on the
cluster (the rollout deployment) and on one machine (one vLLM engine in the eval process, no Ray): per-source
mean@n and pass@k in the RESULT line, scores.json and MLflow match a hand count over the rewards of its
generations.jsonl; and validation in training reports the same scores per source."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil
import pytest

from tests.integration.conftest import REPO, result_of

N, KS = 4, (1, 2, 4)


def _two_sources(cache_dir: Path, out: Path) -> Path:
    """Six prompts of the embedded task's validation split: three of source `arith`, three of `arith_b`."""
    val = next(Path(cache_dir).glob("builtin-v*/val.jsonl"))
    rows = [json.loads(x) for x in val.read_text().splitlines()[:6]]
    for r in rows[3:]:
        r["data_source"] = "arith_b"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def _hand_count(rows: list[dict]) -> dict[str, dict[str, float]]:
    """mean@N and pass@k per source by counting: pass@k is the share of the k-subsets of a prompt's N samples
    that hold a sample of reward 1, averaged over the source's prompts."""
    by_prompt: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in rows:
        by_prompt[(r["data_source"], r["uid"])].append(r["reward"])
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for (src, _), rewards in by_prompt.items():
        assert len(rewards) == N
        for where in (src, "all"):
            out[where][f"mean_at_{N}"].append(sum(rewards) / N)
            for k in KS:
                subsets = list(itertools.combinations(rewards, k))
                out[where][f"pass_at_{k}"].append(
                    sum(any(x >= 1.0 for x in c) for c in subsets) / len(subsets)
                )
    return {src: {m: sum(v) / len(v) for m, v in ms.items()} for src, ms in out.items()}


def test_eval_of_the_final_checkpoint_matches_a_hand_count(ray_cluster, cache_dir, async_keep_run, tmp_path):
    data = _two_sources(cache_dir, tmp_path / "two_sources.jsonl")
    cmd = [
        sys.executable,
        "-m",
        "app",
        "eval",
        "--checkpoint",
        async_keep_run["dir"],
        "--data",
        str(data),
    ]
    cmd += [f"eval.n={N}", f"eval.k=[{','.join(map(str, KS))}]", "tracking.run_name=eval-it"]
    cmd += [f"ray.address={ray_cluster['address']}", f"run_dir={tmp_path}", f"model.cache_dir={cache_dir}"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    eval_s = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(f"training run {async_keep_run['seconds']:.0f}s, eval run {eval_s:.0f}s")
    assert "on the rollout deployment (Ray Serve)" in proc.stderr  # a cluster address: the cluster path
    _check_report(result_of(proc.stdout), proc.stderr, async_keep_run, tmp_path / "eval-it")


def test_eval_on_one_machine_runs_vllm_in_process(cache_dir, async_keep_run, tmp_path):
    """No cluster address (the default on one machine): one vLLM engine inside the eval process, no Ray; the
    same report, and every process the evaluation started is gone when it ends."""
    data = _two_sources(cache_dir, tmp_path / "two_sources.jsonl")
    cmd = [sys.executable, "-m", "app", "eval", "--checkpoint", async_keep_run["dir"], "--data", str(data)]
    cmd += [f"eval.n={N}", f"eval.k=[{','.join(map(str, KS))}]", "tracking.run_name=eval-local"]
    cmd += [f"run_dir={tmp_path}", f"model.cache_dir={cache_dir}"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    t0 = time.monotonic()
    with out.open("w") as fo, err.open("w") as fe:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fo, stderr=fe, text=True)
        started = _descendants_until_exit(proc, timeout=600)
    eval_s = time.monotonic() - t0
    stderr = err.read_text()
    left = [p for p in started if _running(p)]
    for p in left:  # (stopped here by pid, so that a failure leaves nothing running)
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    assert proc.returncode == 0, stderr[-4000:]
    assert not left, f"processes of the evaluation still running after it ended: {left}"
    # vLLM's engine process (the pid it logs with each line), under the eval and gone with it
    engines = {int(pid) for pid in re.findall(r"EngineCore pid=(\d+)", out.read_text() + stderr)}
    assert engines and engines <= {p.pid for p in started}, (engines, started)
    assert not any(ray in cmd for cmd in started.values() for ray in ("raylet", "gcs_server")), started
    print(f"local eval run {eval_s:.0f}s")
    assert "with one vLLM engine in this process (no Ray)" in stderr
    _check_report(result_of(out.read_text()), stderr, async_keep_run, tmp_path / "eval-local")


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _descendants_until_exit(proc: subprocess.Popen, timeout: float) -> dict[psutil.Process, str]:
    """Every process under `proc` seen (polled) while it ran, with its command line as last seen (vLLM names
    its engine process once it runs), until it exits (killed after `timeout`)."""
    seen: dict[int, tuple[psutil.Process, str]] = {}
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError(f"the evaluation did not end within {timeout:.0f}s")
        with contextlib.suppress(psutil.Error):
            for c in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    seen[c.pid] = (seen.get(c.pid, (c, ""))[0], " ".join(c.cmdline()))
        time.sleep(0.5)
    return dict(seen.values())


def _check_report(res: dict, stderr: str, keep_run: dict, eval_dir: Path) -> None:
    """The RESULT record, scores.json and the MLflow run of an evaluation of `keep_run`'s weights on
    `_two_sources` agree with a hand count over its generations.jsonl."""
    from mlflow.tracking import MlflowClient

    assert res["ok"] and res["weights"] == "final export", res
    assert res["model"] == str(Path(keep_run["dir"], "final")), res
    # the run's settings came along (its reward function: `auto`, exact match for these sources)
    assert "settings of the run that wrote the weights" in stderr
    rows = [json.loads(x) for x in Path(res["generations"]).read_text().splitlines()]
    assert len(rows) == 6 * N and {r["data_source"] for r in rows} == {"arith", "arith_b"}
    assert sorted((r["uid"], r["sample"]) for r in rows) == sorted(
        (u, i) for u in {r["uid"] for r in rows} for i in range(N)
    )
    assert all(r["reward"] == float(r["response"].strip() == r["answer"]) for r in rows)
    hand = _hand_count(rows)
    assert set(res["scores"]) == {"arith", "arith_b", "all"}
    for src, metrics in hand.items():
        for name, value in metrics.items():
            assert res["scores"][src][name] == pytest.approx(value), (src, name)
        assert res["scores"][src]["prompts"] == (6 if src == "all" else 3)
    saved = json.loads((eval_dir / "scores.json").read_text())
    assert saved["scores"] == res["scores"]
    by_uid: dict[str, list[float]] = {}
    for r in rows:
        by_uid.setdefault(r["uid"], []).append(r["reward"])
    assert saved["per_prompt"].keys() == by_uid.keys()  # each problem: how many of its samples passed
    assert all(saved["per_prompt"][u]["passed"] == sum(x >= 1.0 for x in v) for u, v in by_uid.items())
    client = MlflowClient(res["tracking_uri"])
    run = client.get_run(res["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["relay.kind"] == "eval"
    for src in ("arith", "arith_b", "all"):
        for name, value in hand[src].items():  # the RESULT record's names are MLflow's
            assert run.data.metrics[f"eval/{src}/{name}"] == pytest.approx(value), (src, name)
    assert {a.path for a in client.list_artifacts(res["run_id"])} >= {"generations.jsonl", "scores.json"}


def test_validation_in_training_reports_mean_and_pass_at_k_per_source(async_keep_run):
    """The run validated with eval.val_n=2 samples per prompt: val/reward is their mean, and mean@2 and
    pass@k of the one source (and `all`) reached MLflow at each validation."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(async_keep_run["tracking_uri"])
    run_id = async_keep_run["run_id"]
    hist = {k: client.get_metric_history(run_id, k) for k in ("val/reward", "val/arith/mean_at_2")}
    assert len(hist["val/reward"]) >= 2 and len(hist["val/arith/mean_at_2"]) == len(hist["val/reward"])
    for a, b in zip(hist["val/reward"], hist["val/arith/mean_at_2"], strict=True):
        assert a.step == b.step and a.value == pytest.approx(b.value)
    for name in ("val/arith/pass_at_1", "val/arith/pass_at_2", "val/all/pass_at_2"):
        values = [m.value for m in client.get_metric_history(run_id, name)]
        assert values and all(0.0 <= v <= 1.0 for v in values), name
