"""Issue 31's algorithm options on the real Learner (tiny Qwen2, CPU, one process, no Ray): PPO mini-batches and
epochs (several optimizer steps per batch, clipped against the trainer's own log-probs at the step's start),
the entropy bonus, and `train.micro_batch_size` taking effect."""

from __future__ import annotations

import math

import pytest
import torch

from app.config import ConfigError, load_config
from app.records import Batch
from app.trainer.batch_tensors import flatten_batch
from app.trainer.learner import Learner
from app.trainer.minibatch import merge_updates, mini_batches
from app.trainer.packing import plan_micro_batches
from tests.test_packed_step import _batch as _two_groups
from tests.test_packed_step import _model_dir


def _batch() -> Batch:
    """Six groups of 3 sequences each (test_packed_step's two groups, three times over, with new ids)."""
    groups = []
    for i in range(3):
        for g in _two_groups().groups:
            g.uid = f"{g.uid}-{i}"
            groups.append(g)
    return Batch(groups=groups)


def _optimizer_steps(learner: Learner) -> int:
    """AdamW's own count of the steps it took (the same for every parameter)."""
    counts = {int(st["step"]) for st in learner.opt.state.values()}
    assert len(counts) == 1, counts
    return counts.pop()


def test_mini_batches_split_groups_in_order():
    batch = _batch()  # 6 groups
    batch.extra = {"async/queue_depth": 2.0}
    assert mini_batches(batch, 0) == [batch] and mini_batches(batch, 6) == [batch]
    parts = mini_batches(batch, 4)
    uids = [g.uid for g in batch.groups]
    assert [[g.uid for g in p.groups] for p in parts] == [uids[:4], uids[4:]]
    assert all(p.extra == {} for p in parts)  # batch-level fields stay with the batch


def test_merge_updates_weights_by_tokens_and_counts_steps():
    def upd(loss: float, norm: float, skipped: float = 0.0) -> dict[str, float]:
        return {
            "loss/policy": loss,
            "actor/clip_frac": loss / 10,
            "actor/grad_norm": norm,
            "actor/is_weight_max": norm,
            "actor/lr": norm,
            "train/skipped_steps": skipped,
            "train/tokens": 0.0,
        }

    m = merge_updates([upd(1.0, 2.0), upd(4.0, 6.0, skipped=1.0)], [30.0, 10.0], batch_tokens=40.0)
    assert m["loss/policy"] == pytest.approx((1 * 30 + 4 * 10) / 40)
    assert m["actor/clip_frac"] == pytest.approx((0.1 * 30 + 0.4 * 10) / 40)
    assert m["actor/grad_norm"] == 4.0 and m["actor/grad_norm_max"] == 6.0 and m["actor/is_weight_max"] == 6.0
    assert m["actor/lr"] == 6.0 and m["train/skipped_steps"] == 1.0 and m["actor/optimizer_steps"] == 1.0
    assert m["train/tokens"] == 40.0
    one = merge_updates([upd(1.0, 2.0)], [30.0], batch_tokens=30.0)
    assert (
        one["loss/policy"] == 1.0 and one["actor/optimizer_steps"] == 1.0 and "actor/grad_norm_max" not in one
    )


@pytest.mark.parametrize("correction", ["tis", "none"])
def test_two_optimizer_steps_per_batch(tmp_path, correction):
    """ppo_mini_batch_size=3 of 6 groups: 2 optimizer steps per batch (AdamW counts them), each with a finite
    loss. Under `tis` the second is clipped against the log-probs the trainer computed at the step's start,
    which the first step moved away from (with one step per batch `tis` clips nothing: the ratio is 1)."""
    path = _model_dir(tmp_path)
    keys = ["train.lr=0.05", f"algorithm.correction={correction}", "algorithm.clip_high=0.01"]
    keys.append("algorithm.clip_low=0.01")
    one = Learner(load_config(None, keys), path, torch.device("cpu"))
    m1 = one.step(_batch())
    assert _optimizer_steps(one) == 1 and m1["actor/optimizer_steps"] == 1.0 and "actor/ppo_kl" not in m1
    if correction == "tis":
        assert m1["actor/clip_frac"] == 0.0
    two = Learner(load_config(None, [*keys, "algorithm.ppo_mini_batch_size=3"]), path, torch.device("cpu"))
    m2 = two.step(_batch())
    assert _optimizer_steps(two) == 2 and m2["actor/optimizer_steps"] == 2.0
    assert two.sched.last_epoch == 2  # the learning-rate schedule counts optimizer steps
    assert math.isfinite(m2["loss/policy"]) and m2["loss/policy"] != 0
    assert m2["actor/clip_frac"] > 0  # the second mini-batch's ratio moved past the 1% clip
    assert m2["actor/ppo_kl"] != 0  # the second update's policy differs from the step's start
    assert m2["train/tokens"] == m1["train/tokens"]  # every token of the batch counted once
    # epochs: each mini-batch twice; 4 optimizer steps, the step's tokens still counted once
    four = Learner(
        load_config(None, [*keys, "algorithm.ppo_mini_batch_size=3", "algorithm.ppo_epochs=2"]),
        path,
        torch.device("cpu"),
    )
    m4 = four.step(_batch())
    assert _optimizer_steps(four) == 4 and m4["actor/optimizer_steps"] == 4.0
    assert m4["train/tokens"] == m1["train/tokens"] and math.isfinite(m4["loss/policy"])


def test_proximal_logprobs_are_the_steps_start(tmp_path):
    """With lr 0 nothing moves: the recomputed log-probs equal every update's own, so `tis` clips nothing
    and the importance weights are those of one step per batch."""
    path = _model_dir(tmp_path)
    keys = ["train.lr=1e-9", "algorithm.correction=tis", "algorithm.ppo_mini_batch_size=2"]
    learner = Learner(load_config(None, keys), path, torch.device("cpu"))
    for g in learner.opt.param_groups:
        g["lr"] = 0.0
    m = learner.step(_batch())
    assert _optimizer_steps(learner) == 3
    assert m["actor/clip_frac"] == 0.0 and m["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
    single = Learner(load_config(None, keys[:2]), path, torch.device("cpu"))
    for g in single.opt.param_groups:
        g["lr"] = 0.0
    s = single.step(_batch())
    assert m["actor/is_weight_mean"] == pytest.approx(s["actor/is_weight_mean"], abs=1e-5)
    assert m["loss/policy"] == pytest.approx(s["loss/policy"], abs=1e-5)


def test_entropy_bonus_raises_entropy(tmp_path):
    """Every reward equal (all advantages 0): the policy loss has no gradient, the entropy bonus alone moves
    the model, towards higher entropy; logged as `actor/entropy` and `loss/entropy_bonus` even with
    `train.log_entropy=false`."""
    path = _model_dir(tmp_path)
    flat = _batch()
    for g in flat.groups:
        for s in g.samples:
            s.reward = 1.0
    keys = ["train.lr=1e-3", "train.log_entropy=false"]
    none = Learner(load_config(None, keys), path, torch.device("cpu")).step(flat)
    assert none["actor/grad_norm"] == 0.0 and "loss/entropy_bonus" not in none
    learner = Learner(load_config(None, [*keys, "algorithm.entropy_coef=0.5"]), path, torch.device("cpu"))
    first = learner.step(flat)
    assert first["actor/grad_norm"] > 0 and first["actor/entropy"] > 0
    assert first["loss/entropy_bonus"] == pytest.approx(-0.5 * first["actor/entropy"])
    later = [
        learner.step(flat)["actor/entropy"] for _ in range(3)
    ]  # near log(40), the uniform's: small steps
    assert first["actor/entropy"] < later[0] < later[1] < later[2] < math.log(40)


def test_micro_batch_size_bounds_sequences_per_pass(tmp_path):
    """`train.micro_batch_size` caps the sequences of a packed pass (it used to be ignored unless packing was
    off) and of a padded one; 0 leaves packing to the token budget alone."""
    lengths = [3, 3, 3, 3, 3]
    assert plan_micro_batches(lengths, 1, 100) == [[[0, 1, 2, 3, 4]]]
    assert [len(mb) for mb in plan_micro_batches(lengths, 1, 100, max_rows=2)[0]] == [2, 2, 1]
    path = _model_dir(tmp_path)
    rows = flatten_batch(_batch(), True)  # 18 sequences
    for keys, passes in (
        ([], 1),
        (["train.micro_batch_size=4"], 5),
        (["train.micro_batch_tokens=0", "train.micro_batch_size=4"], 5),
        (["train.micro_batch_tokens=0"], 1),
    ):
        learner = Learner(load_config(None, keys), path, torch.device("cpu"))
        parts, n = learner._plan(rows)
        assert n == passes and len(parts) == passes, keys
        assert sum(len(p) for p in parts) == len(rows)


def test_mini_batch_larger_than_the_batch_is_refused():
    with pytest.raises(ConfigError, match="ppo_mini_batch_size.*train.batch_groups"):
        load_config(None, ["algorithm.ppo_mini_batch_size=32", "train.batch_groups=16"])
