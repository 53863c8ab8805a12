"""The loss registry: `algorithm.correction` picks a loss from `app.trainer.losses.LOSSES`, and a new variant is one
function plus one registry line (tests/toy_loss.py) that trains like the built-in ones."""

from __future__ import annotations

import pytest
import torch

from app.config import load_config
from app.trainer import losses
from app.trainer.losses import LOSSES, LossInputs
from tests import toy_loss
from tests.test_train_loop import _batch, _setup


def _inputs() -> LossInputs:
    return LossInputs(
        logprobs=torch.tensor([[-1.0, -0.5]]),
        behaviour_logprobs=torch.tensor([[-2.0, -0.5]]),
        advantages=torch.tensor([[1.0, -1.0]]),
        mask=torch.ones(1, 2),
    )


def test_builtin_losses_are_registered_and_typed():
    a = load_config(None, []).algorithm
    assert set(LOSSES) == {"none", "tis", "decoupled"}
    for name, fn in LOSSES.items():
        out = fn(_inputs(), a)
        assert isinstance(out, losses.LossOutputs), name
        assert out.loss_tok.shape == out.clipped.shape == out.is_weight.shape == (1, 2)
    # `none`: ratio e^1 on an A=+1 token is clipped at 1.28; weights are 1
    out = LOSSES["none"](_inputs(), a)
    assert out.loss_tok[0].tolist() == pytest.approx([-1.28, 1.0]) and out.clipped.tolist() == [[True, False]]
    # `tis`: clipped against the trainer's own policy (ratio 1), weighted by min(e^1, is_cap=2)
    out = LOSSES["tis"](_inputs(), a)
    assert out.is_weight[0].tolist() == pytest.approx([2.0, 1.0])
    assert out.loss_tok[0].tolist() == pytest.approx([-2.0, 1.0])
    assert LOSSES["decoupled"](_inputs(), a).is_weight[0, 0].item() == pytest.approx(2.718282, rel=1e-5)


def test_toy_loss_variant_trains_through_the_registry(tmp_path, monkeypatch):
    monkeypatch.setitem(LOSSES, "toy", toy_loss.reinforce)  # the one registry line a new variant needs
    path, tok, prompt = _setup(tmp_path)
    eight, one = tok.convert_tokens_to_ids("8"), tok.convert_tokens_to_ids("1")
    from omegaconf import OmegaConf

    # as the trainer workers get it (app/driver.py sends the config as a plain container)
    cfg = OmegaConf.create(
        OmegaConf.to_container(load_config(None, ["train.lr=0.01", "train.micro_batch_size=4"]))
    )
    cfg.algorithm.correction = "toy"
    from app.trainer.learner import Learner

    learner = Learner(cfg, path, torch.device("cpu"))
    assert learner.loss_fn is toy_loss.reinforce
    batch = _batch(eight, one, tok.eos_token_id, prompt)
    # by hand: advantages +-1 (rewards 1, 0, 0, 1 per group), loss per token -A * logp * WEIGHT
    lp = {t: learner.logprobs_of(prompt, [t, tok.eos_token_id]) for t in (eight, one)}
    adv = {eight: 1.0, one: -1.0}
    expected = sum(-adv[t] * x * toy_loss.WEIGHT for t in (eight, one) for x in lp[t]) / 4
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    m = learner.step(batch)
    assert m["loss/policy"] == pytest.approx(expected, rel=1e-4)  # the toy loss, and no other, ran
    assert m["actor/is_weight_mean"] == pytest.approx(toy_loss.WEIGHT)  # with its own metric tensors
    assert m["actor/clip_frac"] == 0.0 and m["train/skipped_steps"] == 0.0
    assert any(not torch.equal(before[n], p) for n, p in learner.model.named_parameters())  # it trained


def test_trainer_behaviour_logprobs_stand_in_for_the_engines(tmp_path):
    """`rollout.behaviour_logprobs=trainer`: the batch's own log-probs (here made-up values a sampler never
    gave) are ignored; the trainer's at the step's start stand in, so the ratio is 1 (nothing clipped, no
    mismatch) and the policy loss is -mean(A) over the tokens, by hand: advantages +-1, two tokens a sample,
    the same count of each sign -> 0 up to the token-mean's weighting of equal-length responses."""
    from app.trainer.learner import Learner, stand_in_behaviour

    logp, prox = torch.tensor([[-1.0, -2.0]], requires_grad=True), torch.tensor([[-0.5, -0.25]])
    assert (
        stand_in_behaviour(logp, None).tolist() == [[-1.0, -2.0]]
        and not stand_in_behaviour(logp, None).requires_grad
    )
    assert stand_in_behaviour(logp, prox) is not prox and stand_in_behaviour(logp, prox).tolist() == [
        [-0.5, -0.25]
    ]

    path, tok, prompt = _setup(tmp_path)
    eight, one = tok.convert_tokens_to_ids("8"), tok.convert_tokens_to_ids("1")
    keys = ["train.lr=0.01", "train.micro_batch_size=4"]
    engine = Learner(load_config(None, keys), path, torch.device("cpu"))
    m_engine = engine.step(
        _batch(eight, one, tok.eos_token_id, prompt)
    )  # made-up log-probs: ratios far off 1
    assert m_engine["actor/logprob_mismatch"] > 0.1
    trainer = Learner(
        load_config(None, [*keys, "rollout.behaviour_logprobs=trainer"]), path, torch.device("cpu")
    )
    m = trainer.step(_batch(eight, one, tok.eos_token_id, prompt))
    assert m["actor/clip_frac"] == 0.0 and m["actor/logprob_mismatch"] == 0.0
    assert m["actor/is_weight_mean"] == pytest.approx(1.0)
    assert m["loss/policy"] == pytest.approx(0.0, abs=1e-6)  # ratio 1: sum of -A over balanced groups


def test_trainer_behaviour_logprobs_refused_where_a_correction_needs_the_samplers():
    from app.config import ConfigError

    with pytest.raises(ConfigError, match="algorithm.correction=none"):
        load_config(None, ["rollout.behaviour_logprobs=trainer", "algorithm.correction=tis"])
    with pytest.raises(ConfigError, match="fully_async"):
        load_config(None, ["rollout.behaviour_logprobs=trainer", "algorithm.mode=fully_async"])
    cfg = load_config(None, ["rollout.behaviour_logprobs=trainer", "algorithm.mode=one_step_off"])
    assert cfg.rollout.behaviour_logprobs == "trainer"
