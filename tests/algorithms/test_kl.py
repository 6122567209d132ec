"""KL estimators against hand-computed values and derivatives."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algorithms import KL_ESTIMATORS, kl_penalty


def test_registry_names():
    assert set(KL_ESTIMATORS.names()) == {"k1", "k2", "k3", "low_var_kl"}


@pytest.mark.parametrize("logp,ref", [(-1.0, -2.0), (-2.0, -1.0), (-0.3, -0.3), (-5.0, -0.1)])
def test_hand_values_and_gradients(logp, ref):
    d = ref - logp
    expected = {
        "k1": (logp - ref, 1.0),
        "k2": (0.5 * (logp - ref) ** 2, logp - ref),
        "k3": (math.exp(d) - d - 1, 1 - math.exp(d)),
        "low_var_kl": (min(math.exp(d) - d - 1, 10.0), 1 - math.exp(d) if math.exp(d) - d - 1 < 10 else 0.0),
    }
    for kind, (value, grad) in expected.items():
        lp = torch.tensor([[logp]], dtype=torch.float64, requires_grad=True)
        kl = kl_penalty(lp, torch.tensor([[ref]], dtype=torch.float64), kind)
        kl.sum().backward()
        assert kl.item() == pytest.approx(value, rel=1e-12, abs=1e-15), kind
        assert lp.grad.item() == pytest.approx(grad, rel=1e-12, abs=1e-15), kind


def test_k3_and_low_var_clamps():
    lp = torch.tensor([[-100.0, 100.0, -11.0]], dtype=torch.float64)
    ref = torch.zeros_like(lp)
    k3 = kl_penalty(lp, ref, "k3")
    # d = ref - lp clamped to [-20, 20]
    assert k3[0, 0].item() == pytest.approx(math.exp(20) - 21)
    assert k3[0, 1].item() == pytest.approx(math.exp(-20) + 19)
    low = kl_penalty(lp, ref, "low_var_kl")
    assert low[0].tolist() == [10.0, 10.0, 10.0]
    assert torch.isfinite(kl_penalty(torch.tensor([[-1e30]]), torch.tensor([[0.0]]), "k3")).all()


def test_known_nonnegativity():
    lp, ref = torch.randn(50, 20), torch.randn(50, 20)
    assert (kl_penalty(lp, ref, "k2") >= 0).all()
    assert (kl_penalty(lp, ref, "k3") >= 0).all()


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_mask_zeroes_and_blocks_garbage(kind):
    mask = torch.tensor([[True, True, False]])
    lp = torch.tensor([[-1.0, -0.5, float("nan")]], requires_grad=True)
    ref = torch.tensor([[-1.5, -0.5, float("inf")]])
    kl = kl_penalty(lp, ref, kind, response_mask=mask.float())
    kl.sum().backward()
    assert kl[0, 2].item() == 0.0
    assert torch.isfinite(kl).all() and torch.isfinite(lp.grad).all()
    assert lp.grad[0, 2].item() == 0.0
    assert kl[0, 1].item() == 0.0  # equal log-probs -> zero KL for every estimator


def test_ref_is_constant():
    lp = torch.zeros(1, 2, requires_grad=True)
    ref = torch.ones(1, 2, requires_grad=True)
    kl_penalty(lp, ref, "k2").sum().backward()
    assert ref.grad is None


def test_errors():
    with pytest.raises(ValueError, match=r"unknown KL estimator 'kl'; valid names: k1, k2, k3, low_var_kl"):
        kl_penalty(torch.zeros(1, 2), torch.zeros(1, 2), "kl")
    with pytest.raises(ValueError, match="ref_log_probs has shape"):
        kl_penalty(torch.zeros(1, 2), torch.zeros(1, 3), "k1")
    with pytest.raises(ValueError, match="response_mask has shape"):
        kl_penalty(torch.zeros(1, 2), torch.zeros(1, 2), "k1", response_mask=torch.ones(2, 2))
