"""Golden-value tests for app.trainer.grpo; every expected number is derived by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from app.trainer import grpo

LN2, LN3, LN1_5 = math.log(2.0), math.log(3.0), math.log(1.5)
SQRT3 = math.sqrt(3.0)


def close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    torch.testing.assert_close(
        actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-5, check_device=False
    )


# ----------------------------------------------------------------------------------------- masked_mean
def test_masked_mean_ignores_masked_nan_and_guards_empty():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, 6.0, 8.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    close(grpo.masked_mean(x, mask), (1 + 2 + 6 + 8) / 4)  # 4.25
    close(grpo.masked_mean(x, mask, dim=-1), [1.5, 7.0])
    close(grpo.masked_mean(x, torch.zeros_like(mask)), 0.0)  # count clamped to 1 -> 0 / 1


# ----------------------------------------------------------------------------------- group_advantages
def test_group_advantages_golden():
    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 3.0]])
    # g0: mean .5, pop std .5 -> [1, -1, 1, -1];  g1: all equal -> 0
    # g2: mean .75, deviations [-.75]*3 + [2.25], var = (3*.5625 + 5.0625)/4 = 1.6875, std = 3*sqrt3/4
    #     -> -.75 / (3*sqrt3/4) = -1/sqrt3,  2.25 / (3*sqrt3/4) = sqrt3
    expected = [[1, -1, 1, -1], [0, 0, 0, 0], [-1 / SQRT3] * 3 + [SQRT3]]
    close(grpo.group_advantages(rewards, eps=0.0), expected)
    close(grpo.group_advantages(rewards), expected, atol=1e-5)  # eps=1e-6 barely moves it
    # unnormalised: just centred
    centred = [[0.5, -0.5, 0.5, -0.5], [0, 0, 0, 0], [-0.75, -0.75, -0.75, 2.25]]
    close(grpo.group_advantages(rewards, normalize_std=False), centred)


def test_group_advantages_equal_groups_exactly_zero():
    # 0.1 is not exact in binary: mean may differ from 0.1 by an ulp, which 1/eps would amplify
    adv = grpo.group_advantages(torch.full((3, 7), 0.1))
    assert torch.equal(adv, torch.zeros(3, 7))
    assert torch.equal(grpo.group_advantages(torch.tensor([[5.0], [1.0]])), torch.zeros(2, 1))  # n == 1
    close(grpo.group_advantages(torch.tensor([[1, 0]])), [[1.0, -1.0]])  # int rewards -> float


def test_group_advantages_rejects_bad_shape():
    with pytest.raises(ValueError, match=r"\[G, n\]"):
        grpo.group_advantages(torch.zeros(4))


# -------------------------------------------------------------------------------------- clamped_ratio
def test_clamped_ratio_golden_and_clamp():
    logp = torch.tensor([0.0, LN2, -LN2, 1000.0, -1000.0])
    # log-ratios [0, ln2, -ln2, 1000 -> 20, -1000 -> -20]
    close(grpo.clamped_ratio(logp, torch.zeros(5)), [1.0, 2.0, 0.5, math.exp(20), math.exp(-20)])
    close(grpo.clamped_ratio(torch.tensor([3.0]), torch.zeros(1), max_log_ratio=1.0), [math.e])


# ---------------------------------------------------------------------------------------- policy_loss
# clip_low .2, clip_high .28 -> clip range [0.8, 1.28]
#  tok  ratio  A   surr = r*A  clip(r)*A   min     loss  clipped
#  0    1.5   +1   1.5         1.28        1.28   -1.28  yes
#  1    0.5   +1   0.5         0.8         0.5    -0.5   no
#  2    0.5   -1  -0.5        -0.8        -0.8     0.8   yes
#  3    1.5   -2  -3.0        -2.56       -3.0     3.0   no
#  4    1.1   +2   2.2         2.2         2.2    -2.2   no   (inside the range: equal terms)
#  5    1.5   +1   (masked)                        0     no
# d loss / d logp for unclipped tokens = -A * ratio: tok1 -0.5, tok3 +3.0, tok4 -2.2; clipped/masked 0
PL_RATIO = [[1.5, 0.5, 0.5], [1.5, 1.1, 1.5]]
PL_ADV = [[1.0, 1.0, -1.0], [-2.0, 2.0, 1.0]]
PL_MASK = [[1, 1, 1], [1, 1, 0]]


def _pl_inputs():
    logp = torch.tensor(PL_RATIO).log().requires_grad_(True)
    return logp, torch.zeros(2, 3), torch.tensor(PL_ADV), torch.tensor(PL_MASK)


def test_policy_loss_golden():
    logp, old, adv, mask = _pl_inputs()
    loss, clipped = grpo.policy_loss(logp, old, adv, mask)
    close(loss, [[-1.28, -0.5, 0.8], [3.0, -2.2, 0.0]])
    assert clipped.dtype == torch.bool
    assert clipped.tolist() == [[True, False, True], [False, False, False]]


def test_policy_loss_gradient():
    logp, old, adv, mask = _pl_inputs()
    loss, clipped = grpo.policy_loss(logp, old, adv, mask)
    loss.sum().backward()
    close(logp.grad, [[0.0, -0.5, 0.0], [3.0, -2.2, 0.0]])
    ratio, a = torch.tensor(PL_RATIO), torch.tensor(PL_ADV)
    unclipped = mask.bool() & ~clipped
    close(logp.grad[unclipped], (-a * ratio)[unclipped])
    assert torch.all(logp.grad[clipped] == 0)


def test_policy_loss_huge_log_ratio_is_finite():
    logp = torch.tensor([[1000.0, -1000.0, 1000.0, -1000.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, clipped = grpo.policy_loss(logp, torch.zeros(1, 4), adv, torch.ones(1, 4))
    # ratios e^20, e^-20, e^20, e^-20:  A>0 high -> clipped at 1.28; A>0 low -> -e^-20;
    # A<0 high -> unclipped -(-e^20) = e^20 (finite); A<0 low -> clipped at 0.8 -> +0.8
    close(loss, [[-1.28, -math.exp(-20), math.exp(20), 0.8]], atol=1e-3)
    assert clipped.tolist() == [[True, False, False, True]]
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(logp.grad).all()
    assert torch.all(logp.grad == 0)  # beyond the log-ratio clamp there is no gradient


def test_policy_loss_masked_garbage_gives_zero():
    logp = torch.tensor([[0.0, float("nan")]])
    loss, clipped = grpo.policy_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([[1, 0]]))
    close(loss, [[-1.0, 0.0]])
    assert clipped.tolist() == [[False, False]]


# ---------------------------------------------------------------------------------------- tis_weights
def test_tis_weights_golden_and_detached():
    prox = torch.tensor([0.0, LN1_5, LN3, 1000.0, -1000.0], requires_grad=True)
    # exp(prox - behav) = [1, 1.5, 3 -> cap 2, e^20 -> cap 2, e^-20]
    w = grpo.tis_weights(prox, torch.zeros(5))
    close(w, [1.0, 1.5, 2.0, 2.0, math.exp(-20)])
    assert not w.requires_grad
    close(grpo.tis_weights(prox, torch.zeros(5), cap=10.0)[:3], [1.0, 1.5, 3.0])


# ------------------------------------------------------------------------------ decoupled_policy_loss
# tok  logp-prox  ratio  A   ppo loss (as policy_loss)   prox-behav  w    loss = w * ppo   clipped
#  0   ln1.5      1.5   +1  -1.28                        -ln2       0.5  -0.64            yes
#  1   0          1     -1   1.0                          ln2       2.0   2.0 (cap 1.5: 1.5)  no
#  2   -ln2       0.5   +1  -0.5                          0         1.0  -0.5             no
# d loss / d logp: tok0 0 (clipped), tok1 w * -A * ratio = 2 * 1 * 1 = 2, tok2 1 * -1 * 0.5 = -0.5
def _dec_inputs():
    prox = torch.tensor([[0.3, -1.0, -0.7]])
    logp = (prox + torch.tensor([[LN1_5, 0.0, -LN2]])).requires_grad_(True)
    behav = prox - torch.tensor([[-LN2, LN2, 0.0]])
    return logp, prox, behav, torch.tensor([[1.0, -1.0, 1.0]]), torch.ones(1, 3)


def test_decoupled_policy_loss_golden_and_gradient():
    logp, prox, behav, adv, mask = _dec_inputs()
    loss, clipped = grpo.decoupled_policy_loss(logp, prox, behav, adv, mask)
    close(loss, [[-0.64, 2.0, -0.5]])
    assert clipped.tolist() == [[True, False, False]]
    loss.sum().backward()
    close(logp.grad, [[0.0, 2.0, -0.5]])
    capped, _ = grpo.decoupled_policy_loss(logp, prox, behav, adv, mask, cap=1.5)
    close(capped, [[-0.64, 1.5, -0.5]])


def test_decoupled_reduces_to_policy_loss_when_on_policy():
    logp, old, adv, mask = _pl_inputs()
    expected, exp_clipped = grpo.policy_loss(logp, old, adv, mask)
    loss, clipped = grpo.decoupled_policy_loss(logp, old, old, adv, mask)
    close(loss, expected)
    assert torch.equal(clipped, exp_clipped)


def test_decoupled_huge_log_ratios_finite():
    logp = torch.tensor([[1000.0, -1000.0]], requires_grad=True)
    prox = torch.zeros(1, 2)
    behav = torch.tensor([[-1000.0, 1000.0]])  # w = e^20 and e^-20 after the clamp
    loss, _ = grpo.decoupled_policy_loss(logp, prox, behav, torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2))
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(logp.grad).all()
    close(loss, [[math.exp(40), -math.exp(-40)]], atol=1e-3)  # w * ratio * -A: e^20*e^20, -(e^-20)^2


# ----------------------------------------------------------------------------------------- kl_penalty
def test_kl_penalty_golden():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0])
    close(grpo.kl_penalty(logp, ref, "k1"), [1.0, -1.0])  # logp - ref
    # x = ref - logp = [-1, 1]: e^-1 + 1 - 1 = 0.367879;  e - 1 - 1 = 0.718282
    k3 = [math.exp(-1), math.e - 2]
    close(grpo.kl_penalty(logp, ref, "k3"), k3)
    close(grpo.kl_penalty(logp, ref, "low_var_kl"), k3)  # nothing clamped at this scale


def test_kl_penalty_low_var_clamps():
    logp, ref = torch.zeros(3), torch.tensor([1000.0, -1000.0, 2.0])
    # x=1000 -> 20: e^20 - 21 ~ 4.85e8 -> 10;  x=-1000 -> -20: e^-20 + 19 -> 10;  x=2: e^2 - 3 = 4.389056
    close(grpo.kl_penalty(logp, ref, "low_var_kl"), [10.0, 10.0, math.exp(2) - 3])
    close(grpo.kl_penalty(logp, ref, "k1"), [-20.0, 20.0, -2.0])  # k1's log-ratio is clamped too


def test_kl_penalty_k3_clamps_its_log_ratio():
    # x = ref - logp = 100 (past exp's float32 range, 88.7) -> clamped to 20: e^20 - 20 - 1 = 485165174.4;
    # x = -100 -> -20: e^-20 + 20 - 1 = 19.000000002; a logp of -inf (x = +inf) -> 20 as well
    logp, ref = torch.tensor([-100.0, 0.0, float("-inf")]), torch.tensor([0.0, -100.0, 0.0])
    k3 = grpo.kl_penalty(logp, ref, "k3")
    assert torch.isfinite(k3).all()
    close(k3, [math.exp(20) - 21, 19.0, math.exp(20) - 21], atol=1.0)
    # the trainer masks the KL per token: a masked clamped value is 0, never inf * 0 = nan
    masked = k3 * torch.tensor([0.0, 1.0, 0.0])
    assert masked.tolist() == pytest.approx([0.0, 19.0, 0.0])
    # a tighter clamp: x = 100 -> 5: e^5 - 6 = 142.413159
    close(grpo.kl_penalty(logp[:1], ref[:1], "k3", max_log_ratio=5.0), [math.exp(5) - 6], atol=1e-3)


@pytest.mark.parametrize("kind", ["k1", "k3", "low_var_kl"])
def test_kl_penalty_zero_when_equal(kind):
    logp = torch.tensor([[-0.1, -3.0, -12.5]])
    assert torch.equal(grpo.kl_penalty(logp, logp.clone(), kind), torch.zeros(1, 3))


def test_kl_penalty_unknown_kind():
    with pytest.raises(ValueError, match="k1, k3, low_var_kl") as err:
        grpo.kl_penalty(torch.zeros(1), torch.zeros(1), "k2")
    assert "'k2'" in str(err.value)


# ------------------------------------------------------------------------------------------ aggregate
def test_aggregate_token_mean_vs_seq_mean():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), float("nan")]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    close(grpo.aggregate(loss, mask, "token_mean"), 2.5)  # (1+2+3+4) / 4 tokens
    close(grpo.aggregate(loss, mask, "seq_mean"), 3.0)  # (mean(1,2,3)=2 + mean(4)=4) / 2 seqs
    close(grpo.aggregate(loss, mask, "token_mean", num_tokens=8), 1.25)  # 10 / global 8 tokens
    close(grpo.aggregate(loss, mask, "seq_mean", num_seqs=4), 1.5)  # 6 / global 4 seqs


def test_aggregate_empty_masks_guarded():
    loss, mask = torch.ones(2, 3), torch.zeros(2, 3)
    for mode in ("token_mean", "seq_mean"):
        close(grpo.aggregate(loss, mask, mode), 0.0)
        close(grpo.aggregate(loss, mask, mode, num_tokens=0, num_seqs=0), 0.0)
    # one empty sequence contributes 0 but still counts in B: (mean(2,2)=2 + 0) / 2
    close(grpo.aggregate(2 * loss, torch.tensor([[1, 1, 0], [0, 0, 0]]), "seq_mean"), 1.0)


def test_aggregate_unknown_mode():
    with pytest.raises(ValueError, match="token_mean, seq_mean"):
        grpo.aggregate(torch.zeros(1, 1), torch.ones(1, 1), "sum")


def test_aggregate_gradient_token_mean():
    loss = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    grpo.aggregate(loss, torch.tensor([[1, 1], [1, 0]]), "token_mean").backward()
    close(loss.grad, [[1 / 3, 1 / 3], [1 / 3, 0.0]])


# -------------------------------------------------------------------------------- entropy / logprobs
def test_entropy_from_logits_golden():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, LN3, -1e9, -1e9]])
    # uniform over 4: ln4 = 1.386294;  p = [.25, .75]: .25*ln4 + .75*ln(4/3) = 0.562335
    h = grpo.entropy_from_logits(logits)
    close(h, [math.log(4), 0.25 * math.log(4) + 0.75 * math.log(4 / 3)])
    # stability: shifting by +1000 must not overflow, and the entropy is shift invariant
    close(grpo.entropy_from_logits(logits[:1] + 1000.0), [math.log(4)])
    assert h.shape == (2,) and h.dtype == torch.float32
    assert grpo.entropy_from_logits(torch.zeros(2, 3, 5, dtype=torch.bfloat16)).dtype == torch.float32


def test_token_logprobs_golden():
    logits = torch.tensor([[[0.0, LN3], [5.0, 5.0]]])  # [B=1, T=2, V=2]
    tokens = torch.tensor([[1, 0]])
    # row0: p = [.25, .75] -> ln .75 = -0.287682;  row1: p = [.5, .5] -> -ln2 = -0.693147
    out = grpo.token_logprobs(logits, tokens)
    close(out, [[math.log(0.75), -LN2]])
    assert out.shape == (1, 2)
    big = grpo.token_logprobs(logits + 1e4, tokens)  # stable for large logits
    close(big, [[math.log(0.75), -LN2]], atol=1e-3)
    bf = grpo.token_logprobs(torch.full((1, 2, 4), 3.0, dtype=torch.bfloat16), torch.tensor([[0, 3]]))
    assert bf.dtype == torch.float32
    close(bf, [[-math.log(4)] * 2])


# -------------------------------------------------------------------------------------------- dual-clip
def test_dual_clip_caps_negative_advantage_loss():
    # ratios e^[ln5, ln5, ln2, ln0.5], advantages [-1, +1, -2, -1], clip 0.2 / 0.28, clip_ratio_c 3:
    # tok0 A=-1 r=5: max(5, 1.28) = 5 -> capped at 3 * |A| = 3.0 (dual-clipped)
    # tok1 A=+1 r=5: -min(5, 1.28) = -1.28 (upper clip; dual-clip only touches A < 0)
    # tok2 A=-2 r=2: max(4, 2.56) = 4 < 3 * 2 = 6: unchanged 4.0
    # tok3 A=-1 r=0.5: max(0.5, 0.8) = 0.8 (lower clip) < 3: unchanged 0.8
    logp = torch.log(torch.tensor([[5.0, 5.0, 2.0, 0.5]]))
    old, adv, mask = torch.zeros(1, 4), torch.tensor([[-1.0, 1.0, -2.0, -1.0]]), torch.ones(1, 4)
    loss, clipped = grpo.policy_loss(logp, old, adv, mask, 0.2, 0.28, clip_ratio_c=3.0)
    close(loss, [[3.0, -1.28, 4.0, 0.8]])
    assert clipped.tolist() == [[True, True, False, True]]
    plain, _ = grpo.policy_loss(logp, old, adv, mask, 0.2, 0.28)
    close(plain, [[5.0, -1.28, 4.0, 0.8]])  # off by default


def test_dual_clip_has_no_gradient_past_the_cap_and_respects_mask():
    logp = torch.log(torch.tensor([[5.0, 5.0]])).requires_grad_(True)
    loss, clipped = grpo.policy_loss(
        logp, torch.zeros(1, 2), torch.tensor([[-1.0, -1.0]]), torch.tensor([[1.0, 0.0]]), clip_ratio_c=3.0
    )
    close(loss, [[3.0, 0.0]])
    assert clipped.tolist() == [[True, False]]  # masked tokens never count as clipped
    loss.sum().backward()
    close(logp.grad, [[0.0, 0.0]])


def test_dual_clip_in_decoupled_loss():
    # on-policy prox == behav: weight 1, so the decoupled loss equals the dual-clipped PPO loss
    logp = torch.log(torch.tensor([[5.0]]))
    prox = behav = torch.zeros(1, 1)
    loss, clipped = grpo.decoupled_policy_loss(
        logp, prox, behav, torch.tensor([[-1.0]]), torch.ones(1, 1), clip_ratio_c=3.0
    )
    close(loss, [[3.0]])
    assert clipped.tolist() == [[True]]
