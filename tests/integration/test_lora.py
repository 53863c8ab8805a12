"""LoRA RL end to end (`--config lora`, fully_async, real vLLM CPU replicas): only the adapter is pushed, each
replica loads it beside the old one without pausing (rollout.partial=finish_on_old) and acknowledges the
adapter tensors' checksums (sync.verify: a mismatch fails the push, and the run); every sample's tokens carry
one version; the final checkpoint is a PEFT adapter plus the merged model."""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from pathlib import Path

from tests.integration.conftest import REPO, train_cmd


def test_lora_fully_async_pushes_adapters_without_a_pause(ray_cluster, cache_dir, tmp_path):
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    from app.config import load_config

    assert load_config("lora", []).sync.verify  # the acknowledged checksums are checked against the trainer's
    name = "lora-async"
    cmd = train_cmd(
        ray_cluster,
        cache_dir,
        tmp_path,
        name,
        "algorithm.mode=fully_async",
        "algorithm.max_staleness=1",
        "train.steps=3",
        "train.batch_groups=4",
        "rollout.n=4",
        # long generations (EOS ignored), few decoded at once: pushes land while samples are generating
        "rollout.max_tokens=48",
        "rollout.ignore_eos=true",
        "rollout.max_num_seqs=4",
        "rollout.max_inflight=6",
        "data.val_size=8",
        "algorithm.val_every=2",
        "model.lora_merge=true",
        "train.workers=1",  # one trainer rank (the sync + resumed run below trains on two)
        config="lora",
    )
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = re.findall(r"RESULT (\{.*\})", proc.stdout)
    res = json.loads(line)
    assert res["ok"] and res["steps"] == 3 and res["weight_version"] == 3, res

    # the export: a PEFT adapter (what was pushed) and the merged model
    final = tmp_path / name / "final"
    adapter_cfg = json.loads((final / "adapter_config.json").read_text())
    assert adapter_cfg["peft_type"] == "LORA" and adapter_cfg["r"] == 16 and adapter_cfg["lora_alpha"] == 32
    tensors = load_file(str(final / "adapter_model.safetensors"))
    assert tensors and all(k.startswith("base_model.model.model.layers.") for k in tensors)
    assert (final / "merged" / "config.json").exists()

    client = MlflowClient(res["tracking_uri"])
    history = lambda key: [m.value for m in client.get_metric_history(res["run_id"], key)]  # noqa: E731
    # only the adapter's bytes were pushed, and no replica ever paused generation for a push
    adapter_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert set(history("sync/bytes")) == {float(adapter_bytes)}
    assert history("sync/pause_s") and max(history("sync/pause_s")) == 0.0
    # pushes landed while requests were in flight: those finished on the adapter they were admitted under
    assert max(history("sync/requests_on_old")) > 0
    # finish_on_old: every sample's tokens carry one version (the adapter it was admitted under), and
    # staleness counts them
    trained = [json.loads(x) for x in (tmp_path / name / "trained_groups.jsonl").read_text().splitlines()]
    assert len(trained) == 12 and all(span == 0 for t in trained for span in t["sample_spans"]), trained
    assert history("staleness/max")


def _optimizer_steps(checkpoint: str) -> set[int]:
    """The AdamW step counts held in a CLI run's checkpoint (torch.distributed.checkpoint, read as one dict)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as d:
        dcp_to_torch_save(str(Path(checkpoint) / "model"), f"{d}/sd.pt")
        sd = torch.load(f"{d}/sd.pt", weights_only=False)
    return {int(st["step"]) for st in sd["optim"]["state"].values()}


def test_lora_sync_then_resumed_one_step_off_restores_the_adapter(ray_cluster, cache_dir, tmp_path):
    """LoRA in the other two modes, and `--resume` through the CLI. Run S (sync, 2 steps) is on-policy: the
    trainer's log-probs of each batch equal the engine's behaviour log-probs (base + the pushed adapter) up to
    numerics, which `actor/logprob_mismatch` measures at every step. Run R resumes S's final checkpoint in
    one_step_off for one more step: its checkpoint's optimizer has taken 3 steps (S's 2 restored, with the
    adapters they belong to, + 1), and its pushes were adapter-only and acknowledged."""
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    small = ["train.batch_groups=4", "rollout.n=4", "data.val_size=8", "algorithm.val_every=2"]
    small += ["train.save_every=1"]

    def run(name: str, *extra: str, resume: str = "") -> tuple[dict, dict[str, list[float]]]:
        cmd = train_cmd(ray_cluster, cache_dir, tmp_path, name, *small, *extra, config="lora")
        proc = subprocess.run(
            cmd + (["--resume", resume] if resume else []),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        (line,) = re.findall(r"RESULT (\{.*\})", proc.stdout)
        res = json.loads(line)
        assert res["ok"], res
        client = MlflowClient(res["tracking_uri"])
        keys = ("actor/logprob_mismatch", "sync/pause_s", "sync/bytes", "ckpt/restored_step")
        return res, {k: [m.value for m in client.get_metric_history(res["run_id"], k)] for k in keys}

    res_s, hist_s = run("lora-sync", "algorithm.mode=sync", "train.steps=2")
    assert res_s["steps"] == 2 and res_s["weight_version"] == 2, res_s
    # on-policy: the engine's base + adapter log-probs are the trainer's (fp32 on CPU), at v0 and after a push
    assert len(hist_s["actor/logprob_mismatch"]) == 2 and max(hist_s["actor/logprob_mismatch"]) < 0.02, hist_s
    assert max(hist_s["sync/pause_s"]) == 0.0
    trained_s = load_file(str(tmp_path / "lora-sync" / "final" / "adapter_model.safetensors"))
    assert max(float(t.abs().max()) for k, t in trained_s.items() if "lora_B" in k) > 1e-4  # B left zero
    assert _optimizer_steps(res_s["checkpoint"]) == {2}

    res_r, hist_r = run(
        "lora-resumed", "algorithm.mode=one_step_off", "train.steps=3", resume=str(tmp_path / "lora-sync")
    )
    assert res_r["restored_from"] and res_r["restored_from"]["step"] == 2, res_r
    assert res_r["steps"] == 3 and hist_r["ckpt/restored_step"] == [2.0], (res_r, hist_r)
    assert set(hist_r["sync/bytes"]) == set(hist_s["sync/bytes"])  # adapter-only pushes, acknowledged
    assert _optimizer_steps(res_r["checkpoint"]) == {3}  # restored (a fresh optimizer would say 1)
    print(f"\nlora: sync logprob mismatch {hist_s['actor/logprob_mismatch']}; resumed optimizer at 3 steps")
