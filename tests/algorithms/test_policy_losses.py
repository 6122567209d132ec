"""Policy losses checked against an independent float64 numpy reference (python loops + finite differences)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_rl.algorithms import POLICY_LOSSES, aggregate, policy_loss

LOSSES = ("ppo", "gspo", "gspo_token", "sapo", "cispo")
AGGS = (
    ("token-mean", None),
    ("seq-mean-token-sum", None),
    ("seq-mean-token-mean", None),
    ("seq-mean-token-sum-norm", None),
    ("seq-mean-token-sum-norm", 16.0),
)
CLIP_LOW, CLIP_HIGH, CLIP_C = 0.2, 0.28, 1.5
LENGTHS = (6, 4, 1, 0, 5)  # one empty row
T = 6


# ----------------------------------------------------------------------------- independent reference


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def ref_token_losses(name, lp, lp_sg, olp, adv, mask, clip_c=None, tau_pos=1.0, tau_neg=1.05):
    """Per-token loss from the papers' formulas; ``lp_sg`` is the stop-gradient copy of ``lp``."""
    B, L = lp.shape
    out = np.zeros((B, L))
    lo, hi = 1 - CLIP_LOW, 1 + CLIP_HIGH
    for b in range(B):
        valid = [t for t in range(L) if mask[b, t]]
        if not valid:
            continue
        seq_mean = sum(lp[b, t] - olp[b, t] for t in valid) / len(valid)
        seq_mean_sg = sum(lp_sg[b, t] - olp[b, t] for t in valid) / len(valid)
        for t in valid:
            a = adv[b, t]
            if name == "ppo":
                r = math.exp(lp[b, t] - olp[b, t])
                obj = min(r * a, _clip(r, lo, hi) * a)
                if clip_c is not None and a < 0:
                    obj = max(obj, clip_c * a)
            elif name in ("gspo", "gspo_token"):
                log_s = seq_mean if name == "gspo" else seq_mean_sg + lp[b, t] - lp_sg[b, t]
                s = math.exp(log_s)
                obj = min(s * a, _clip(s, lo, hi) * a)
            elif name == "sapo":
                r = math.exp(lp[b, t] - olp[b, t])
                tau = tau_pos if a > 0 else tau_neg
                obj = _sigmoid(tau * (r - 1)) * 4 / tau * a
            elif name == "cispo":
                w = _clip(math.exp(lp_sg[b, t] - olp[b, t]), lo, hi)
                obj = w * a * lp[b, t]
            else:
                raise AssertionError(name)
            out[b, t] = -obj
    return out


def ref_aggregate(loss, mask, mode, norm=None):
    B, L = loss.shape
    rows = [[loss[b, t] for t in range(L) if mask[b, t]] for b in range(B)]
    nonempty = [r for r in rows if r]
    if mode == "token-mean":
        n = sum(len(r) for r in rows)
        return sum(sum(r) for r in rows) / n if n else 0.0
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in nonempty) / len(nonempty) if nonempty else 0.0
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in nonempty) / len(nonempty) if nonempty else 0.0
    if mode == "seq-mean-token-sum-norm":
        return sum(sum(r) for r in rows) / ((L if norm is None else norm) * B)
    raise AssertionError(mode)


def ref_loss(name, lp, lp_sg, olp, adv, mask, mode, norm, weights=None, **kw):
    tok = ref_token_losses(name, lp, lp_sg, olp, adv, mask, **kw)
    if weights is not None:
        tok = tok * weights
    return ref_aggregate(tok, mask, mode, norm)


def ref_grad(name, lp, olp, adv, mask, mode, norm, h=1e-6, **kw):
    """Central finite differences of the reference loss wrt ``lp`` (stop-gradient copy held fixed)."""
    grad = np.zeros_like(lp)
    for idx in np.ndindex(*lp.shape):
        plus, minus = lp.copy(), lp.copy()
        plus[idx] += h
        minus[idx] -= h
        f_plus = ref_loss(name, plus, lp, olp, adv, mask, mode, norm, **kw)
        f_minus = ref_loss(name, minus, lp, olp, adv, mask, mode, norm, **kw)
        grad[idx] = (f_plus - f_minus) / (2 * h)
    return grad


# ----------------------------------------------------------------------------- data


def make_mask(lengths=LENGTHS, length=T) -> np.ndarray:
    return np.array([[t < n for t in range(length)] for n in lengths])


def make_batch(seed: int = 0, token_adv: bool = True):
    """Off-policy batch whose token and sequence log-ratios sit away from every clip kink."""
    rng = np.random.default_rng(seed)
    mask = make_mask()
    grid = np.array([-0.9, -0.5, -0.3, -0.1, 0.05, 0.12, 0.3, 0.6])
    log_ratio = rng.choice(grid, size=mask.shape) + rng.uniform(-0.01, 0.01, size=mask.shape)
    olp = rng.uniform(-3.0, -0.1, size=mask.shape)
    lp = olp + log_ratio
    adv = rng.normal(size=mask.shape) if token_adv else np.repeat(rng.normal(size=(mask.shape[0], 1)), T, axis=1)
    kinks = [math.log(1 - CLIP_LOW), math.log(1 + CLIP_HIGH), math.log(CLIP_C), 0.0]
    for b in range(mask.shape[0]):
        if mask[b].any():
            seq = log_ratio[b][mask[b]].mean()
            assert min(abs(seq - k) for k in kinks) > 1e-3, "pick another seed: a sequence sits on a clip kink"
    return lp, olp, adv, mask


def to_torch(lp, olp, adv, mask):
    lp_t = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    return lp_t, torch.tensor(olp), torch.tensor(adv), torch.tensor(mask)


# ----------------------------------------------------------------------------- value and gradient vs reference


@pytest.mark.parametrize("mode,norm", AGGS)
@pytest.mark.parametrize("name,clip_c", [(n, None) for n in LOSSES] + [("ppo", CLIP_C)])
def test_loss_and_grad_match_reference(name, clip_c, mode, norm):
    lp, olp, adv, mask = make_batch(seed=0)
    lp_t, olp_t, adv_t, mask_t = to_torch(lp, olp, adv, mask)
    loss, _ = policy_loss(
        name, lp_t, olp_t, adv_t, mask_t, agg=mode, agg_norm=norm, clip_low=CLIP_LOW, clip_high=CLIP_HIGH, clip_c=clip_c
    )
    loss.backward()
    expected = ref_loss(name, lp, lp, olp, adv, mask, mode, norm, clip_c=clip_c)
    expected_grad = ref_grad(name, lp, olp, adv, mask, mode, norm, clip_c=clip_c)
    assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    np.testing.assert_allclose(lp_t.grad.numpy(), expected_grad, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", LOSSES)
def test_rollout_weights_multiply_token_loss(name):
    lp, olp, adv, mask = make_batch(seed=0)
    weights = np.random.default_rng(1).uniform(0.0, 2.0, size=lp.shape)
    lp_t, olp_t, adv_t, mask_t = to_torch(lp, olp, adv, mask)
    loss, _ = policy_loss(
        name, lp_t, olp_t, adv_t, mask_t, clip_low=CLIP_LOW, clip_high=CLIP_HIGH, rollout_weights=torch.tensor(weights)
    )
    loss.backward()
    expected = ref_loss(name, lp, lp, olp, adv, mask, "token-mean", None, weights=weights)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    expected_grad = ref_grad(name, lp, olp, adv, mask, "token-mean", None, weights=weights)
    np.testing.assert_allclose(lp_t.grad.numpy(), expected_grad, rtol=1e-6, atol=1e-8)


def test_sequence_advantages_broadcast():
    lp, olp, adv, mask = make_batch(seed=0, token_adv=False)
    lp_t, olp_t, adv_t, mask_t = to_torch(lp, olp, adv, mask)
    for name in LOSSES:
        token_form, _ = policy_loss(name, lp_t, olp_t, adv_t, mask_t)
        seq_form, _ = policy_loss(name, lp_t, olp_t, adv_t[:, 0], mask_t)
        assert token_form.item() == seq_form.item()


# ----------------------------------------------------------------------------- on-policy closed forms


@pytest.mark.parametrize("mode,norm", AGGS)
@pytest.mark.parametrize("name", LOSSES)
def test_on_policy_closed_form(name, mode, norm):
    """At θ = θ_old every ratio is 1: loss = agg(-A) (sapo: agg(-2A/τ), cispo: agg(-A·logp)), grad = -A·∂agg."""
    rng = np.random.default_rng(3)
    mask = make_mask()
    lp = rng.uniform(-3.0, -0.1, size=mask.shape)
    seq_adv = rng.normal(size=mask.shape[0])
    adv = np.repeat(seq_adv[:, None], T, axis=1)
    lp_t = torch.tensor(lp, requires_grad=True)
    loss, metrics = policy_loss(
        name, lp_t, lp_t.detach().clone(), torch.tensor(seq_adv), torch.tensor(mask), agg=mode, agg_norm=norm
    )
    loss.backward()

    if name == "sapo":
        token_obj = np.where(adv > 0, 2 / 1.0, 2 / 1.05) * adv
    elif name == "cispo":
        token_obj = adv * lp
    else:
        token_obj = adv
    assert loss.item() == pytest.approx(ref_aggregate(-token_obj, mask, mode, norm), rel=1e-12, abs=1e-15)
    # ∂agg/∂l_bt: the aggregation weight of each token, from the reference aggregator (it is linear).
    agg_weight = np.zeros_like(lp)
    for idx in np.ndindex(*lp.shape):
        unit = np.zeros_like(lp)
        unit[idx] = 1.0
        agg_weight[idx] = ref_aggregate(unit, mask, mode, norm)
    np.testing.assert_allclose(lp_t.grad.numpy(), -adv * agg_weight, rtol=1e-12, atol=1e-15)

    assert metrics["ppo_kl"].item() == 0.0
    for key in ("clip_frac_low", "clip_frac_high", "clip_frac_dual"):
        assert metrics[key].item() == 0.0
    for key in ("ratio_mean", "ratio_max", "ratio_min"):
        assert metrics[key].item() == 1.0


def test_ppo_kl_exactly_zero_in_float32():
    lp = torch.randn(8, 33) * 5
    mask = torch.rand(8, 33) > 0.3
    _, metrics = policy_loss("ppo", lp, lp.clone(), torch.randn(8), mask)
    assert metrics["ppo_kl"].item() == 0.0
    assert metrics["ppo_kl"].dim() == 0 and not metrics["ppo_kl"].requires_grad


def test_ppo_kl_sign_and_ratio_metrics():
    old = torch.zeros(1, 3, dtype=torch.float64)
    new = torch.tensor([[0.1, -0.2, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False]])
    _, m = policy_loss("ppo", new, old, torch.ones(1), mask)
    assert m["ppo_kl"].item() == pytest.approx((0.0 - 0.1 + 0.0 + 0.2) / 2)  # mean(old - new)
    assert m["ratio_max"].item() == pytest.approx(math.exp(0.1))
    assert m["ratio_min"].item() == pytest.approx(math.exp(-0.2))
    assert m["ratio_mean"].item() == pytest.approx((math.exp(0.1) + math.exp(-0.2)) / 2)


# ----------------------------------------------------------------------------- GSPO


@pytest.mark.parametrize("mode,norm", AGGS)
def test_gspo_and_gspo_token_agree_for_sequence_advantages(mode, norm):
    rng = np.random.default_rng(5)
    mask = torch.tensor(make_mask())
    olp = torch.tensor(rng.uniform(-3.0, -0.1, size=mask.shape))
    # Wide log-ratios so that some sequences are clipped, one even beyond the ±20 clamp.
    log_ratio = torch.tensor(rng.normal(scale=0.4, size=mask.shape))
    log_ratio[0] += 30.0
    adv = torch.tensor(rng.normal(size=mask.shape[0]))
    results = []
    for name in ("gspo", "gspo_token"):
        lp = (olp + log_ratio).requires_grad_()
        loss, metrics = policy_loss(name, lp, olp, adv, mask, agg=mode, agg_norm=norm)
        loss.backward()
        results.append((loss.detach(), lp.grad, metrics))
    (loss_a, grad_a, m_a), (loss_b, grad_b, m_b) = results
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_a, grad_b, rtol=1e-12, atol=1e-12)
    assert m_a["clip_frac_low"] + m_a["clip_frac_high"] > 0
    for key in m_a:
        torch.testing.assert_close(m_a[key], m_b[key])


def test_gspo_clips_whole_sequence_and_clamps_sequence_log_ratio():
    # Sequence 0: token log-ratios +0.5 and -0.4 -> log s = 0.05 (inside the clip range even though
    # the tokens are not); sequence 1: mean 30 -> clamped to 20, clipped (A > 0) so zero gradient.
    lp = torch.tensor([[0.5, -0.4], [40.0, 20.0]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(2, 2, dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.bool)
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    loss, metrics = policy_loss("gspo", lp, old, adv, mask, agg="seq-mean-token-mean")
    loss.backward()
    s0 = math.exp(0.05)
    assert loss.item() == pytest.approx((-s0 - 1.2) / 2, rel=1e-12)
    np.testing.assert_allclose(lp.grad[0].numpy(), [-s0 / 2 / 2] * 2, rtol=1e-12)
    assert lp.grad[1].abs().sum().item() == 0.0
    assert metrics["clip_frac_high"].item() == pytest.approx(0.5)
    assert metrics["ratio_max"].item() == pytest.approx(math.exp(20.0))


def test_gspo_clamps_the_sequence_mean_not_each_token():
    # Token log-ratios 30 and 0: the sequence mean 15 is inside [-20, 20], so s = e^15 (a per-token clamp
    # would give e^10). A < 0 keeps the unclipped branch, so loss = s and the gradient flows.
    lp = torch.tensor([[30.0, 0.0]], dtype=torch.float64, requires_grad=True)
    for name in ("gspo", "gspo_token"):
        loss, _ = policy_loss(name, lp, torch.zeros_like(lp), -torch.ones(1, dtype=torch.float64), torch.ones(1, 2))
        (grad,) = torch.autograd.grad(loss, lp)
        assert loss.item() == pytest.approx(math.exp(15.0), rel=1e-12)  # token-mean of s, s
        np.testing.assert_allclose(grad.numpy(), [[math.exp(15.0) / 2] * 2], rtol=1e-12)


def test_gspo_token_uses_per_token_advantages():
    # Unclipped: ∂loss/∂logp_t = -s·A_t / n for one sequence under token-mean.
    lp = torch.tensor([[0.1, -0.1, 0.05]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.float64)
    loss, _ = policy_loss("gspo_token", lp, torch.zeros_like(lp), adv, torch.ones(1, 3))
    loss.backward()
    s = math.exp(0.05 / 3)
    np.testing.assert_allclose(lp.grad.numpy(), -s * adv.numpy() / 3, rtol=1e-12)


def test_gspo_gives_token_weights_through_their_sequence_mean_and_gspo_token_per_token():
    # Row 0 is unclipped: log s = (0.01 - 0.02 + 0.04)/3 = 0.01, A = 1.5, weights (2, 0, 1), mean weight 1.
    # Row 1 is clipped: log s = 0.4 > log 1.2 with A = 1, weights (0.5, 1.5) (the third slot is padding).
    # seq-mean-token-mean over S = 2 rows: loss = ½·[-(1/3)(2+0+1)·1.5·s - (1/2)(0.5+1.5)·1.2] for both variants.
    lp = torch.tensor([[0.01, -0.02, 0.04], [0.5, 0.3, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    weights = torch.tensor([[2.0, 0.0, 1.0], [0.5, 1.5, 7.0]], dtype=torch.float64)
    adv = torch.tensor([1.5, 1.0], dtype=torch.float64)
    s = math.exp(0.01)
    grads = {}
    for name in ("gspo", "gspo_token"):
        leaf = lp.clone().requires_grad_()
        loss, _ = policy_loss(
            name, leaf, torch.zeros_like(lp), adv, mask, agg="seq-mean-token-mean", rollout_weights=weights
        )
        loss.backward()
        assert loss.item() == pytest.approx(0.5 * (-1.5 * s - 1.2), rel=1e-14)
        grads[name] = leaf.grad
    # gspo: ∂/∂logp_t = ½·(1/3)·w̄·(-A·s) for each token of row 0: the zero-weight token is still trained.
    np.testing.assert_allclose(grads["gspo"][0].numpy(), [-0.25 * s] * 3, rtol=1e-14)
    # gspo_token: ½·(1/3)·w_t·(-A·s): each token keeps its own weight (verl's gspo), the zero-weight token gets 0.
    np.testing.assert_allclose(grads["gspo_token"][0].numpy(), [-0.5 * s, 0.0, -0.25 * s], rtol=1e-14)
    for name in grads:  # clipped row and padding: no gradient
        assert grads[name][1].abs().sum().item() == 0.0


# ----------------------------------------------------------------------------- SAPO


@pytest.mark.parametrize("tau", [0.5, 1.0, 1.05, 3.0])
def test_sapo_gate_value_and_slope_at_one(tau):
    lp = torch.zeros(1, 1, dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(
        "sapo", lp, torch.zeros(1, 1, dtype=torch.float64), torch.ones(1), torch.ones(1, 1), tau_pos=tau
    )
    loss.backward()
    assert loss.item() == pytest.approx(-(4 / tau) * 0.5, rel=1e-14)  # f(1) = 4/τ · ½
    assert lp.grad.item() == pytest.approx(-1.0, rel=1e-14)  # f'(1)·r = 1


def test_sapo_asymmetric_temperatures():
    """Same ratio, A = ±1: weight 4σ(1-σ) with σ = σ(τ(r-1)); τ_neg > τ_pos decays the negative side faster."""
    log_r = math.log(1.6)
    lp = torch.full((2, 1), log_r, dtype=torch.float64, requires_grad=True)
    loss, m = policy_loss(
        "sapo",
        lp,
        torch.zeros(2, 1, dtype=torch.float64),
        torch.tensor([1.0, -1.0], dtype=torch.float64),
        torch.ones(2, 1),
        agg="seq-mean-token-sum",
        tau_pos=1.0,
        tau_neg=2.0,
    )
    loss.backward()
    r = 1.6

    def slope(tau):
        p = _sigmoid(tau * (r - 1))
        return 4 * p * (1 - p) * r

    assert lp.grad[0].item() == pytest.approx(-slope(1.0) / 2, rel=1e-12)
    assert lp.grad[1].item() == pytest.approx(slope(2.0) / 2, rel=1e-12)
    assert abs(lp.grad[1].item()) < abs(lp.grad[0].item())
    expected = (-(_sigmoid(r - 1) * 4) + _sigmoid(2 * (r - 1)) * 2) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert m["clip_frac_low"].item() == 0.0 and m["clip_frac_high"].item() == 0.0


# ----------------------------------------------------------------------------- PPO clip and dual-clip


def test_ppo_clip_fractions():
    # ratios: 1.5 (A>0: high clip), 1.5 (A<0: unclipped), 0.5 (A<0: low clip), 0.5 (A>0: unclipped), 1.0
    ratios = [1.5, 1.5, 0.5, 0.5, 1.0]
    lp = torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 1.0]], dtype=torch.float64)
    _, m = policy_loss("ppo", lp, torch.zeros_like(lp), adv, torch.ones(1, 5))
    assert m["clip_frac_high"].item() == pytest.approx(1 / 5)
    assert m["clip_frac_low"].item() == pytest.approx(1 / 5)
    assert m["clip_frac_dual"].item() == 0.0


def test_dual_clip_caps_negative_advantage_loss():
    ratios = [0.5, 1.1, 2.0, 4.0, 4.0]
    adv = [-1.0, -1.0, -1.0, -1.0, 1.0]
    lp = torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64, requires_grad=True)
    a = torch.tensor([adv], dtype=torch.float64)
    loss, m = policy_loss("ppo", lp, torch.zeros_like(lp), a, torch.ones(1, 5), agg="seq-mean-token-sum", clip_c=3.0)
    loss.backward()
    # Per-token: low-clipped 0.8, unclipped 1.1, unclipped 2.0, dual-capped 3.0, high-clipped -1.2.
    assert loss.item() == pytest.approx(0.8 + 1.1 + 2.0 + 3.0 - 1.2, rel=1e-12)
    np.testing.assert_allclose(lp.grad.numpy(), [[0.0, 1.1, 2.0, 0.0, 0.0]], rtol=1e-12, atol=0)
    assert m["clip_frac_dual"].item() == pytest.approx(1 / 5)
    assert m["clip_frac_low"].item() == pytest.approx(1 / 5)
    assert m["clip_frac_high"].item() == pytest.approx(1 / 5)

    plain, m_plain = policy_loss(
        "ppo", lp.detach(), torch.zeros_like(lp), a, torch.ones(1, 5), agg="seq-mean-token-sum"
    )
    assert plain.item() == pytest.approx(0.8 + 1.1 + 2.0 + 4.0 - 1.2, rel=1e-12)  # dual-clip is off by default
    assert m_plain["clip_frac_dual"].item() == 0.0


# ----------------------------------------------------------------------------- CISPO


def test_cispo_gradient_is_clipped_weight_times_advantage():
    ratios = [0.5, 0.9, 1.1, 3.0]
    adv = [1.0, -2.0, 0.5, -1.0]
    old = torch.tensor([[-1.0, -2.0, -0.5, -0.3]], dtype=torch.float64)
    lp = (old + torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64)).requires_grad_()
    loss, m = policy_loss("cispo", lp, old, torch.tensor([adv], dtype=torch.float64), torch.ones(1, 4), clip_high=0.5)
    loss.backward()
    weights = [0.8, 0.9, 1.1, 1.5]
    np.testing.assert_allclose(lp.grad.numpy(), [[-w * a / 4 for w, a in zip(weights, adv, strict=True)]], rtol=1e-12)
    assert loss.item() == pytest.approx(
        -sum(w * a * x for w, a, x in zip(weights, adv, lp.detach()[0].tolist(), strict=True)) / 4
    )
    assert m["clip_frac_low"].item() == pytest.approx(1 / 4)
    assert m["clip_frac_high"].item() == pytest.approx(1 / 4)


# ----------------------------------------------------------------------------- numerical safety


@pytest.mark.parametrize("garbage", [float("nan"), 1e30, -1e30, float("inf")])
@pytest.mark.parametrize("name", LOSSES)
def test_masked_positions_never_leak(name, garbage):
    lp, olp, adv, mask = make_batch(seed=0)
    results = []
    for dirty in (False, True):
        lp_t, olp_t, adv_t, mask_t = to_torch(lp, olp, adv, mask)
        if dirty:
            lp_t = torch.where(mask_t, lp_t, garbage)
            olp_t = torch.where(mask_t, olp_t, -garbage)
            adv_t = torch.where(mask_t, adv_t, garbage)
        lp_leaf = lp_t if not dirty else lp_t.detach().requires_grad_()
        for mode, norm in AGGS:
            loss, metrics = policy_loss(
                name, lp_leaf, olp_t, adv_t, mask_t.double(), agg=mode, agg_norm=norm, clip_c=None
            )
            (grad,) = torch.autograd.grad(loss, lp_leaf)
            results.append((loss.detach(), grad, metrics))
    clean, dirty = results[: len(AGGS)], results[len(AGGS) :]
    for (loss_c, grad_c, m_c), (loss_d, grad_d, m_d) in zip(clean, dirty, strict=True):
        assert torch.isfinite(loss_d) and torch.isfinite(grad_d).all()
        assert torch.equal(loss_c, loss_d)
        assert torch.equal(grad_c, grad_d)
        assert (grad_d[~torch.tensor(mask)] == 0).all()
        for key in m_c:
            assert torch.equal(m_c[key], m_d[key]), key


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_extreme_log_ratios_stay_finite(name, dtype):
    log_ratio = torch.tensor(
        [[1e4, -1e4, 50.0, -50.0], [1e30, 1e30, 1e30, 1e30], [-1e30, -1e30, 0.0, 0.0]], dtype=dtype
    )
    old = torch.full_like(log_ratio, -1.0)
    lp = (old + log_ratio).requires_grad_()
    for adv in (torch.tensor([1.0, -1.0, -1.0], dtype=dtype), torch.tensor([-1.0, 1.0, 1.0], dtype=dtype)):
        for mode, norm in AGGS:
            loss, metrics = policy_loss(name, lp, old, adv, torch.ones_like(lp), agg=mode, agg_norm=norm)
            (grad,) = torch.autograd.grad(loss, lp)
            assert torch.isfinite(loss), (mode, loss)
            assert torch.isfinite(grad).all(), (mode, grad)
            for key in ("clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_max", "ratio_min"):
                assert torch.isfinite(metrics[key]), key


@pytest.mark.parametrize("name", LOSSES)
def test_empty_batch_gives_zero(name):
    lp = torch.full((3, 4), float("nan"), requires_grad=True)
    for mode, norm in AGGS:
        loss, metrics = policy_loss(
            name, lp, torch.zeros(3, 4), torch.ones(3), torch.zeros(3, 4), agg=mode, agg_norm=norm
        )
        (grad,) = torch.autograd.grad(loss, lp)
        assert loss.item() == 0.0
        assert (grad == 0).all()
        assert all(torch.isfinite(v) for v in metrics.values())


def test_bfloat16_inputs_computed_in_float32():
    lp = torch.randn(2, 5).to(torch.bfloat16).requires_grad_()
    loss, _ = policy_loss("ppo", lp, lp.detach(), torch.randn(2).to(torch.bfloat16), torch.ones(2, 5))
    loss.backward()
    assert loss.dtype == torch.float32 and lp.grad.dtype == torch.bfloat16


def test_aggregation_is_the_callers_choice_for_gspo_and_sapo():
    lp, olp, adv, mask = make_batch(seed=0, token_adv=False)
    lp_t, olp_t, adv_t, mask_t = to_torch(lp, olp, adv, mask)
    for name in ("gspo", "sapo"):
        token_mean, _ = policy_loss(name, lp_t, olp_t, adv_t, mask_t, agg="token-mean")
        seq_mean, _ = policy_loss(name, lp_t, olp_t, adv_t, mask_t, agg="seq-mean-token-mean")
        assert token_mean.item() != pytest.approx(seq_mean.item())


# ----------------------------------------------------------------------------- errors


def _call(**overrides):
    args = dict(
        name="ppo",
        log_probs=torch.zeros(2, 3),
        old_log_probs=torch.zeros(2, 3),
        advantages=torch.zeros(2),
        response_mask=torch.ones(2, 3),
    )
    args.update(overrides)
    return policy_loss(**args)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(name="grpo"), r"unknown policy loss 'grpo'; valid names: cispo, gspo, gspo_token, ppo, sapo"),
        (dict(agg="mean"), r"unknown aggregation mode 'mean'; valid names: .*token-mean"),
        (dict(clip_low=-0.1), "clip_low must be >= 0"),
        (dict(clip_high=-0.1), "clip_high must be >= 0"),
        (dict(clip_high=float("nan")), "clip_high must be >= 0"),
        (dict(clip_c=1.0), r"clip_c \(dual-clip constant\) must be > 1"),
        (dict(clip_c=0.5), r"clip_c \(dual-clip constant\) must be > 1"),
        (dict(name="gspo", clip_c=3.0), "clip_c .* not supported by policy loss 'gspo'"),
        (dict(tau_pos=0.0), "tau_pos must be a positive"),
        (dict(tau_neg=-1.0), "tau_neg must be a positive"),
        (dict(old_log_probs=torch.zeros(2, 4)), r"old_log_probs has shape \(2, 4\), expected \(2, 3\)"),
        (dict(response_mask=torch.ones(3, 3)), r"response_mask has shape \(3, 3\)"),
        (dict(advantages=torch.zeros(3)), r"advantages must be \[batch\] or \[batch, response_len\]"),
        (dict(advantages=torch.zeros(2, 4)), r"advantages must be"),
        (dict(log_probs=torch.zeros(6), old_log_probs=torch.zeros(6)), r"log_probs must be \[batch, response_len\]"),
        (dict(rollout_weights=torch.ones(2, 2)), r"rollout_weights has shape"),
        (dict(agg="token-mean", agg_norm=4.0), "norm only applies to aggregation mode 'seq-mean-token-sum-norm'"),
        (dict(agg="seq-mean-token-sum-norm", agg_norm=0.0), "norm must be positive"),
    ],
)
def test_invalid_options_raise(overrides, match):
    with pytest.raises(ValueError, match=match):
        _call(**overrides)


def test_registry_lists_all_losses():
    assert set(LOSSES) <= set(POLICY_LOSSES.names())


def test_aggregate_is_public_and_consistent():
    loss_mat = torch.tensor([[1.0, 2.0], [3.0, float("nan")]])
    mask = torch.tensor([[1, 1], [1, 0]])
    assert aggregate(loss_mat, mask, "token-mean").item() == pytest.approx(2.0)
