"""LoRA RL end to end (`--config lora`, real vLLM CPU replicas, two trainer ranks), one lineage of three CLI
runs, each resuming the one before through the CLI (`--resume`), so every mode runs with LoRA:

- run S, `sync` for two steps: on-policy, so the trainer's log-probs of each batch equal the engine's behaviour
  log-probs (base + the pushed adapter) up to numerics, which `actor/logprob_mismatch` measures at every step;
- run O, S resumed in `one_step_off` for one step: the optimizer and the adapter it belongs to are restored
  (its checkpoint's optimizer has taken 3 steps; a fresh one would say 1), adapter-only pushes;
- run R, O resumed in `fully_async` for three steps: only the adapter is pushed, each replica loads it beside
  the old one without pausing (rollout.partial=finish_on_old) and acknowledges the adapter tensors' checksums
  (sync.verify: a mismatch fails the push, and the run); every sample's tokens carry one version; the final
  checkpoint is a PEFT adapter plus the merged model.

(One lineage instead of separate runs per mode: each run's start-up is most of its time in `make test`.)
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from pathlib import Path

from tests.integration.conftest import REPO, train_cmd

SMALL = ("train.batch_groups=4", "rollout.n=4", "data.val_size=8", "algorithm.val_every=2", "train.workers=2")


def _run(ray_cluster, cache_dir, tmp_path, name: str, *extra: str, resume: str = "") -> dict:
    """One `--config lora` CLI run; its RESULT, with `history(key)` for its MLflow metrics."""
    from mlflow.tracking import MlflowClient

    cmd = train_cmd(ray_cluster, cache_dir, tmp_path, name, *extra, config="lora")
    proc = subprocess.run(
        cmd + (["--resume", resume] if resume else []), cwd=REPO, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = re.findall(r"RESULT (\{.*\})", proc.stdout)
    res = json.loads(line)
    assert res["ok"], res
    client = MlflowClient(res["tracking_uri"])
    res["history"] = lambda key: [m.value for m in client.get_metric_history(res["run_id"], key)]
    return res


def test_lora_sync_then_one_step_off_then_fully_async_pushes_adapters_without_a_pause(
    ray_cluster, cache_dir, tmp_path
):
    from safetensors.torch import load_file

    from app.config import load_config

    assert load_config("lora", []).sync.verify  # the acknowledged checksums are checked against the trainer's
    res_s = _run(
        ray_cluster, cache_dir, tmp_path, "lora-sync", *SMALL, "algorithm.mode=sync", "train.steps=2"
    )
    assert res_s["steps"] == 2 and res_s["weight_version"] == 2, res_s
    # on-policy: the engine's base + adapter log-probs are the trainer's (fp32 on CPU), at v0 and after a push
    mismatch = res_s["history"]("actor/logprob_mismatch")
    assert len(mismatch) == 2 and max(mismatch) < 0.02, mismatch
    assert max(res_s["history"]("sync/pause_s")) == 0.0
    trained_s = load_file(str(tmp_path / "lora-sync" / "final" / "adapter_model.safetensors"))
    assert max(float(t.abs().max()) for k, t in trained_s.items() if "lora_B" in k) > 1e-4  # B left zero
    assert _optimizer_steps(res_s["checkpoint"]) == {2}

    res_o = _run(
        ray_cluster,
        cache_dir,
        tmp_path,
        "lora-off",
        *SMALL,
        "algorithm.mode=one_step_off",
        "train.steps=3",
        resume=str(tmp_path / "lora-sync"),
    )
    assert res_o["restored_from"] and res_o["restored_from"]["step"] == 2, res_o
    assert res_o["steps"] == 3 and res_o["history"]("ckpt/restored_step") == [2.0], res_o
    assert set(res_o["history"]("sync/bytes")) == set(res_s["history"]("sync/bytes"))  # adapter only, acked
    assert max(res_o["history"]("sync/pause_s")) == 0.0
    assert _optimizer_steps(res_o["checkpoint"]) == {3}  # restored (a fresh optimizer would say 1)

    name = "lora-async"
    res = _run(
        ray_cluster,
        cache_dir,
        tmp_path,
        name,
        *SMALL,
        "algorithm.mode=fully_async",
        "algorithm.max_staleness=1",
        "train.steps=6",
        # long generations (EOS ignored), few decoded at once: pushes land while samples are generating
        "rollout.max_tokens=48",
        "rollout.ignore_eos=true",
        "rollout.max_num_seqs=4",
        "rollout.max_inflight=6",
        "model.lora.merge=true",
        resume=str(tmp_path / "lora-off"),
    )
    history = res["history"]
    assert res["restored_from"] and res["restored_from"]["step"] == 3, res
    assert res["steps"] == 6 and res["weight_version"] == 6 and history("ckpt/restored_step") == [3.0], res
    assert _optimizer_steps(res["checkpoint"]) == {6}  # O's 3 restored (a fresh optimizer would say 3)

    # the export: a PEFT adapter (what was pushed) and the merged model
    final = tmp_path / name / "final"
    adapter_cfg = json.loads((final / "adapter_config.json").read_text())
    assert adapter_cfg["peft_type"] == "LORA" and adapter_cfg["r"] == 16 and adapter_cfg["lora_alpha"] == 32
    tensors = load_file(str(final / "adapter_model.safetensors"))
    assert tensors and all(k.startswith("base_model.model.model.layers.") for k in tensors)
    assert (final / "merged" / "config.json").exists()

    # only the adapter's bytes were pushed (as in S), and no replica ever paused generation for a push
    adapter_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert set(history("sync/bytes")) == set(res_s["history"]("sync/bytes")) == {float(adapter_bytes)}
    assert history("sync/pause_s") and max(history("sync/pause_s")) == 0.0
    # pushes landed while requests were in flight: those finished on the adapter they were admitted under
    assert max(history("sync/requests_on_old")) > 0
    # finish_on_old: every sample's tokens carry one version (the adapter it was admitted under), and
    # staleness counts them
    trained = [json.loads(x) for x in (tmp_path / name / "trained_groups.jsonl").read_text().splitlines()]
    assert len(trained) == 12 and all(span == 0 for t in trained for span in t["sample_spans"]), trained
    assert history("staleness/max")
    print(f"\nlora: sync logprob mismatch {mismatch}; one_step_off, then fully_async, optimizer at 6 steps")


def _optimizer_steps(checkpoint: str) -> set[int]:
    """The AdamW step counts held in a CLI run's checkpoint (torch.distributed.checkpoint, read as one dict)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as d:
        dcp_to_torch_save(str(Path(checkpoint) / "model"), f"{d}/sd.pt")
        sd = torch.load(f"{d}/sd.pt", weights_only=False)
    return {int(st["step"]) for st in sd["optim"]["state"].values()}
