"""ioGRPO-mKL loss and advantages against hand-computed values."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch

from pipeline.core.grpo import group_advantages, grpo_mkl_terms, k3, level_weights, normalise

LN2 = math.log(2)
K3_UP, K3_DOWN = 1 - LN2, LN2 - 0.5  # k3 at ref - logp = +ln2 and -ln2


def _case(requires_grad: bool = False):
    """Seq 0: A=+1, ratios [1.5, 0.5, 1.1]; seq 1: A=-2, ratios [1.5, 0.5] + one padding token."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]], dtype=torch.float64)
    ratio = torch.tensor([[1.5, 0.5, 1.1], [1.5, 0.5, 9.0]], dtype=torch.float64)
    logp = (old + ratio.log()).clone().requires_grad_(requires_grad)
    d = torch.tensor([[LN2, 0.0, -LN2], [LN2, LN2, 5.0]], dtype=torch.float64)  # ref - logp
    ref = logp.detach() + d
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
    return logp, old, ref, adv, mask


def test_k3_estimates_kl_of_the_sampling_distribution_and_its_roles_matter():
    """k3(q, p) = p/q - 1 - log(p/q) on a token sampled from q. Hand values: q = 1/4, p = 1/2 gives 2 - 1 - ln 2;
    swapped, 1/2 - 1 + ln 2. The case of docs/learning-log.md: the reference sampled a token at log p = -1.43 that
    training pushed to -31.16. The loss's k3(π_θ, π_ref) is e^29.73 - 29.73 - 1 ≈ 8.16e12, while KL(π_ref‖π_θ) on
    the reference's sample, k3(π_ref, π_θ), is e^-29.73 + 29.73 - 1 ≈ 28.73."""
    q, p = torch.tensor([math.log(0.25)], dtype=torch.float64), torch.tensor([math.log(0.5)], dtype=torch.float64)
    assert k3(q, p).item() == pytest.approx(1 - LN2, abs=1e-12)
    assert k3(p, q).item() == pytest.approx(LN2 - 0.5, abs=1e-12)
    ref, new = torch.tensor([-1.43], dtype=torch.float64), torch.tensor([-31.16], dtype=torch.float64)
    assert k3(new, ref).item() == pytest.approx(8.158e12, rel=1e-4)
    assert k3(ref, new).item() == pytest.approx(28.73, abs=1e-9)
    # an exact expectation: under q = (1/4, 3/4), p = (1/2, 1/2), E_q[k3(q, p)] = KL(q‖p) = 3/4 ln(3/2) + 1/4 ln(1/2)
    qs, ps = torch.tensor([0.25, 0.75], dtype=torch.float64), torch.tensor([0.5, 0.5], dtype=torch.float64)
    assert float((qs * k3(qs.log(), ps.log())).sum()) == pytest.approx(0.75 * math.log(1.5) - 0.25 * LN2, abs=1e-12)


def test_sequence_norm_masked_kl_hand_computed():
    # pg per token: seq0 min(1.5,1.2)=1.2 (clipped), min(0.5,0.8)=0.5, 1.1 -> mean 2.8/3
    #               seq1 min(-3,-2.4)=-3, min(-1,-1.6)=-1.6 (clipped) -> mean -2.3
    # KL: seq0 mean k3 = (K3_UP + 0 + K3_DOWN)/3 = 0.5/3 ; seq1 = K3_UP, masked out (A < 0)
    terms = grpo_mkl_terms(*_case(), beta=0.1, clip_eps=0.2, kl_mask=True)
    pg0, pg1 = 2.8 / 3, -2.3
    assert terms.pg_loss.item() == pytest.approx(-(pg0 + pg1) / 2, abs=1e-12)
    assert terms.loss.item() == pytest.approx(-((pg0 - 0.1 * 0.5 / 3) + pg1) / 2, abs=1e-12)
    assert terms.loss.item() == pytest.approx(0.69166666666, abs=1e-9)
    assert terms.kl.item() == pytest.approx((0.5 / 3 + K3_UP) / 2, abs=1e-12)
    assert terms.clip_frac.item() == pytest.approx(2 / 5)  # seq0 token 0 (above 1+ε, A>0), seq1 token 1 (below)
    assert terms.ratio_dev.item() == pytest.approx(0.5)  # max |ρ - 1| over [1.5, .5, 1.1, 1.5, .5]; padding's 9 out


def test_kl_unmasked_penalises_negative_advantages_too():
    masked = grpo_mkl_terms(*_case(), beta=0.1, clip_eps=0.2, kl_mask=True).loss.item()
    full = grpo_mkl_terms(*_case(), beta=0.1, clip_eps=0.2, kl_mask=False).loss.item()
    assert full - masked == pytest.approx(0.1 * K3_UP / 2, abs=1e-12)
    assert full == pytest.approx(0.7070093076, abs=1e-9)  # ((2.8/3 - 0.1*0.5/3) - 2.3 - 0.1*K3_UP) / -2


def test_masked_kl_ignores_reference_of_negative_sequences():
    logp, old, ref, adv, mask = _case()
    ref2 = ref.clone()
    ref2[1] -= 3.0  # move the A<0 sequence's reference far away
    a = grpo_mkl_terms(logp, old, ref, adv, mask, beta=0.5, clip_eps=0.2).loss
    b = grpo_mkl_terms(logp, old, ref2, adv, mask, beta=0.5, clip_eps=0.2).loss
    assert a.item() == pytest.approx(b.item(), abs=1e-12)


def test_token_norm_hand_computed():
    # all 5 completion tokens: pg sum = 1.2+0.5+1.1-3-1.6 = -1.8; masked KL sum = 0.5 (seq0 only)
    terms = grpo_mkl_terms(*_case(), beta=0.1, clip_eps=0.2, norm="token")
    assert terms.pg_loss.item() == pytest.approx(0.36, abs=1e-12)
    assert terms.loss.item() == pytest.approx((1.8 + 0.1 * 0.5) / 5, abs=1e-12)


def test_gradient_vanishes_on_clipped_tokens_both_sides():
    logp, old, ref, adv, mask = _case(requires_grad=True)
    grpo_mkl_terms(logp, old, ref, adv, mask, beta=0.0, clip_eps=0.2).loss.backward()
    g = logp.grad
    # d(-mean)/dlogp = -(1/B)(1/|y|) ρA on unclipped tokens, 0 on clipped ones and padding
    want = torch.tensor([[0.0, -(1 / 2) * (1 / 3) * 0.5, -(1 / 2) * (1 / 3) * 1.1],
                         [-(1 / 2) * (1 / 2) * (1.5 * -2), 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(g, want, rtol=0, atol=1e-12)


def test_no_reference_means_no_kl():
    logp, old, _, adv, mask = _case()
    terms = grpo_mkl_terms(logp, old, None, adv, mask, beta=0.1, clip_eps=0.2)
    # the same per-token pg as test_sequence_norm_masked_kl_hand_computed: -(2.8/3 - 2.3)/2, and nothing else
    assert terms.kl.item() == 0.0 and terms.loss.item() == pytest.approx(-(2.8 / 3 - 2.3) / 2, abs=1e-12)


def test_ratio_one_gives_advantage_weighted_objective():
    z = torch.zeros(2, 2, dtype=torch.float64)
    terms = grpo_mkl_terms(z, z, z, torch.tensor([2.0, -1.0], dtype=torch.float64), torch.ones(2, 2), 0.1, 0.2)
    assert terms.loss.item() == pytest.approx(-(2.0 - 1.0) / 2) and terms.clip_frac.item() == 0.0


def test_shape_errors_are_clear():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="same"):
        grpo_mkl_terms(z, torch.zeros(2, 2), z, torch.zeros(2), z, 0.1, 0.2)
    with pytest.raises(ValueError, match="advantages"):
        grpo_mkl_terms(z, z, z, torch.zeros(3), z, 0.1, 0.2)
    with pytest.raises(ValueError, match="norm"):
        grpo_mkl_terms(z, z, z, torch.zeros(2), z, 0.1, 0.2, norm="batch")


def test_public_loss_is_importable_from_train_with_the_documented_signature():
    from pipeline.stages.train import grpo_mkl_loss

    params = list(inspect.signature(grpo_mkl_loss).parameters)
    assert params[:8] == ["logp", "old_logp", "ref_logp", "advantages", "completion_mask", "beta", "clip_eps",
                          "kl_mask"]
    loss = grpo_mkl_loss(*_case(), 0.1, 0.2)
    assert loss.item() == pytest.approx(0.69166666666, abs=1e-9)


def test_group_advantages_hand_computed():
    np.testing.assert_allclose(group_advantages([0, 1, 1, 0], eps=0.0), [-1, 1, 1, -1])
    np.testing.assert_allclose(group_advantages([0, 1], eps=1e-6), [-0.5 / 0.500001, 0.5 / 0.500001])
    # scores [0.1, 0.3, 0.7, 0.9]: mean 0.5, population std sqrt(0.1)
    s = math.sqrt(0.1)
    np.testing.assert_allclose(group_advantages([0.1, 0.3, 0.7, 0.9], eps=0.0), [-0.4 / s, -0.2 / s, 0.2 / s, 0.4 / s])


def test_all_equal_group_has_zero_advantages():
    assert group_advantages([0.3, 0.3, 0.3]).tolist() == [0.0, 0.0, 0.0]


def test_normalise_uses_given_statistics():
    np.testing.assert_allclose(normalise([1.0, 3.0], 2.0, 1.0, eps=0.0), [-1.0, 1.0])
    np.testing.assert_allclose(normalise([1.0], 0.0, 0.0, eps=0.5), [2.0])


# ---- two-level: an agent term and a workflow term (the proposal's L_GRPO, §4.3) -----------------------------


def test_level_weights_hand_computed():
    levels, lengths = ["agent", "workflow", "workflow", "workflow"], [2, 1, 4, 2]
    # sequence norm: c_b = w_l / (n_l T_b): agent 1/(1*2); workflows 1/(3*1), 1/(3*4), 1/(3*2)
    np.testing.assert_allclose(level_weights(levels, lengths, {"agent": 1.0, "workflow": 1.0}),
                               [1 / 2, 1 / 3, 1 / 12, 1 / 6])
    np.testing.assert_allclose(level_weights(levels, lengths, {"agent": 0.5, "workflow": 2.0}),
                               [1 / 4, 2 / 3, 1 / 6, 1 / 3])
    # token norm: c_b = w_l / N_l with N_agent = 2 and N_workflow = 1 + 4 + 2 = 7 tokens
    np.testing.assert_allclose(level_weights(levels, lengths, {"agent": 1.0, "workflow": 1.0}, "token"),
                               [1 / 2, 1 / 7, 1 / 7, 1 / 7])


def _two_level_case(d: float = 0.0):
    """One plan (A^A = +.5, 2 tokens) and three workflows (A^W = +1, +1, -1, 1 token each) at ratio 1; every
    token has ref - logp = d."""
    logp = torch.zeros(4, 2, dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0], [1, 0], [1, 0]], dtype=torch.float64)
    adv = torch.tensor([0.5, 1.0, 1.0, -1.0], dtype=torch.float64)
    c = torch.tensor(level_weights(["agent", "workflow", "workflow", "workflow"], [2, 1, 1, 1],
                                   {"agent": 1.0, "workflow": 1.0}))
    return logp, logp.clone(), logp + d, adv, mask, c


def test_two_level_loss_sums_an_agent_and_a_workflow_term():
    logp, old, ref, adv, mask, c = _two_level_case()
    # ρ = 1, no KL: L = -[mean_i A^A_i + mean_ij A^W_ij] = -[.5 + (1 + 1 - 1)/3] = -5/6
    terms = grpo_mkl_terms(logp, old, ref, adv, mask, 0.1, 0.2, False, seq_weights=c)
    assert terms.loss.item() == pytest.approx(-5 / 6, abs=1e-12)
    assert terms.pg_loss.item() == pytest.approx(-5 / 6, abs=1e-12)
    # pooling the four sequences as equals gives the plan 1/4 of the weight: -(.5 + 1 + 1 - 1)/4
    assert grpo_mkl_terms(logp, old, ref, adv, mask, 0.1, 0.2, False).loss.item() == pytest.approx(-0.375)


def test_two_level_kl_switch_per_level():
    logp, old, ref, adv, mask, c = _two_level_case(d=LN2)  # k3 = 1 - ln2 on every token
    # the proposal's KL (unmasked on both levels): each term adds β·K3: -[.5 - .1K + 1/3 - .1K]
    unmasked = grpo_mkl_terms(logp, old, ref, adv, mask, 0.1, 0.2, torch.tensor([False] * 4), seq_weights=c)
    assert unmasked.loss.item() == pytest.approx(-(0.5 + 1 / 3) + 0.2 * K3_UP, abs=1e-12)
    # workflow KL masked (A > 0 only): the A^W = -1 workflow carries none: -[.5 - .1K + (1 + 1 - 1 - .2K)/3]
    wf_masked = grpo_mkl_terms(logp, old, ref, adv, mask, 0.1, 0.2, torch.tensor([False, True, True, True]),
                               seq_weights=c)
    assert wf_masked.loss.item() == pytest.approx(-(0.5 - 0.1 * K3_UP + (1 - 0.2 * K3_UP) / 3), abs=1e-12)
    assert unmasked.kl.item() == pytest.approx(K3_UP, abs=1e-12)  # logged: the plain mean of k3
