"""Reference log-probs computed off the trainer agree with the trainer's own for the initial model."""

from __future__ import annotations

import torch

from app.config import load_config
from app.records import Batch, Group, Sample
from app.rollout.reference import RefWorker
from app.tasks import tiny
from app.trainer.learner import Learner


def test_reference_worker_matches_trainer(tmp_path):
    root = tiny.ensure_builtin(tmp_path / "cache", warmup_steps=5)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(root / "model")
    prompt = tok.encode("max:3815=", add_special_tokens=False)
    completions = [tok.encode(x, add_special_tokens=False) for x in ("8", "51", "3815", "")]
    completions = [[*c, tok.eos_token_id] for c in completions[:3]] + [[]]
    path = str(root / "model")
    learner = Learner(load_config(None, []), path, torch.device("cpu"))  # the initial policy
    ref = RefWorker(path, "float32").logprobs(prompt, completions)
    assert ref[3] == []
    worst = 0.0
    for c, r in zip(completions[:3], ref[:3]):
        mine = learner.logprobs_of(prompt, c)
        assert len(mine) == len(r) == len(c)
        worst = max(worst, max(abs(a - b) for a, b in zip(mine, r)))
    assert worst <= 1e-3, worst

    # the trainer uses them: KL of the initial policy to itself is ~0, and no reference copy is kept
    cfg = load_config(None, ["algorithm.kl_coef=0.1", "ref.workers=1", "train.micro_batch_size=8"])
    learner = Learner(cfg, path, torch.device("cpu"))
    assert learner.ref is None
    samples = []
    for c, r in zip(completions[:3], ref[:3]):
        lp = learner.logprobs_of(prompt, c)
        samples.append(
            Sample(
                token_ids=c,
                logprobs=lp,
                versions=[0] * len(c),
                finish_reason="stop",
                reward=float(c[0] == completions[0][0]),
                ref_logprobs=r,
            )
        )
    m = learner.step(Batch(groups=[Group(uid="g", prompt_ids=prompt, answer="8", samples=samples)]))
    assert abs(m["loss/kl"]) < 1e-3
    samples[0].ref_logprobs = None
    import pytest

    with pytest.raises(RuntimeError, match="no reference log-probs"):
        learner.step(Batch(groups=[Group(uid="g", prompt_ids=prompt, answer="8", samples=samples)]))
