"""LoRA RL end to end (`--config lora`, fully_async, real vLLM CPU replicas): only the adapter is pushed, each
replica loads it beside the old one without pausing (rollout.partial=finish_on_old) and acknowledges the
adapter tensors' checksums (sync.verify: a mismatch fails the push, and the run); every sample's tokens carry
one version; the final checkpoint is a PEFT adapter plus the merged model."""

from __future__ import annotations

import json
import re
import subprocess

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
