"""Issue 31's outputs, without Ray: the sampled training rollouts (`rollouts.jsonl`) and the HF export in the
model's dtype."""

from __future__ import annotations

import json

import pytest
import torch

from app.config import load_config
from app.records import Batch, Group, Sample
from app.trainer.learner import Learner
from app.trainer.rollout_log import RolloutLog, version_spans
from tests.test_packed_step import _model_dir


def _group(uid: str, k: int) -> Group:
    samples = [
        Sample(
            token_ids=[5, 6, 7],
            logprobs=[-1.0] * 3,
            versions=[3, 3, 4] if i == 0 else [4, 4, 4],
            finish_reason="stop" if i else "length",
            text=f"answer {uid}-{i}",
            reward=float(i % 2),
            reward_extras={"format": 1.0, "correct": float(i % 2)},
            reward_error="timeout" if i == 2 else None,
        )
        for i in range(k)
    ]
    return Group(
        uid=uid, prompt_ids=[1, 2], answer="42", samples=samples, prompt_text=f"q {uid}=", data_source="s"
    )


def test_version_spans():
    assert version_spans([3, 3, 4]) == [[3, 0, 2], [4, 2, 3]]
    assert version_spans([7]) == [[7, 0, 1]] and version_spans([]) == []


def test_rollouts_jsonl_samples_each_step(tmp_path):
    batch = Batch(groups=[_group("a", 4), _group("b", 4)])
    log = RolloutLog(tmp_path, per_step=3, seed=1)
    assert log.append(1, 0, batch) == 3 and log.append(2, 1, batch) == 3
    lines = [json.loads(x) for x in log.path.read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 1, 1, 2, 2, 2]
    first = lines[0]
    assert set(first) >= {"prompt", "response", "reward", "sub_scores", "versions", "finish_reason", "answer"}
    by_response = {x["response"]: x for x in lines}
    for resp, x in by_response.items():
        uid, i = resp.split()[1].split("-")
        assert x["prompt"] == f"q {uid}=" and x["uid"] == uid and x["data_source"] == "s"
        assert x["reward"] == float(int(i) % 2) and x["sub_scores"] == {"format": 1.0, "correct": x["reward"]}
        assert x["versions"] == ([[3, 0, 2], [4, 2, 3]] if i == "0" else [[4, 0, 3]])
        assert x["reward_error"] == ("timeout" if i == "2" else None)
    again = RolloutLog(tmp_path / "again", per_step=3, seed=1)
    (tmp_path / "again").mkdir()
    again.append(1, 0, batch)
    assert again.path.read_text().splitlines() == log.path.read_text().splitlines()[:3]  # seeded
    assert log.truncate(1) == 3 and len(log.path.read_text().splitlines()) == 3  # a restore to step 1
    assert RolloutLog(tmp_path / "none", per_step=0).append(1, 0, batch) == 0
    assert not (tmp_path / "none" / "rollouts.jsonl").exists()
    small = RolloutLog(tmp_path, per_step=50)  # more than the batch holds: all of it, once
    assert small.append(3, 2, batch) == 8


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_hf_export_is_in_the_model_dtype(tmp_path, dtype):
    """The final export has `model.dtype` (it was float32 whatever the model's), holding the trainer's float32
    weights cast to it, and loads back."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    path = _model_dir(tmp_path)
    learner = Learner(load_config(None, [f"model.dtype={dtype}"]), path, torch.device("cpu"))
    out = tmp_path / "final"
    learner.save_hf(str(out), path)
    want = getattr(torch, dtype)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = f.keys()
        assert {f.get_tensor(k).dtype for k in names} == {want}
    assert AutoConfig.from_pretrained(out).dtype == want
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=want).state_dict()
    for name, p in learner.model.state_dict().items():
        assert torch.equal(loaded[name], p.to(want)), name
