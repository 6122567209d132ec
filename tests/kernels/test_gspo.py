"""Packed GSPO / GSPO-token loss (torch and Triton) against ``policy_loss(..., agg="seq-mean-token-mean")`` on
the padded batch, computed in float64. The Triton cases run compiled on a GPU and in the interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algorithms.policy_losses import policy_loss
from megatron_rl.kernels import packed_gspo_loss, resolve_gspo_impl
from tests.kernels.conftest import DEVICE

LENGTHS = [5, 9, 3, 7, 1, 4]
LONG_LENGTHS = [2500, 0, 17, 1100]  # sequences longer than the kernel's 1024-token block, and an empty one
IMPLS = ["torch", "triton"]


def make_packed(seed: int, lengths: list[int], *, per_token_adv: bool, log_ratio_scale: float) -> dict:
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    old = -3 * torch.rand(total, generator=gen, dtype=torch.float64)
    new = old + log_ratio_scale * torch.randn(total, generator=gen, dtype=torch.float64)
    mask = torch.rand(total, generator=gen) > 0.2
    if len(lengths) > 4:
        mask[sum(lengths[:4]) : sum(lengths[:5])] = False  # one sequence with no valid token
    adv = torch.randn(total if per_token_adv else len(lengths), generator=gen, dtype=torch.float64)
    weights = 2 * torch.rand(total, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return {"log_probs": new, "old": old, "adv": adv, "cu": cu, "mask": mask, "weights": weights, "lengths": lengths}


def padded(values: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(list(values.split(lengths)), batch_first=True)


def reference(data: dict, variant: str, clip: tuple[float, float], weights: bool) -> tuple[torch.Tensor, ...]:
    """float64 ``policy_loss`` on the padded batch: loss, packed gradient, clip fractions."""
    lengths = data["lengths"]
    padded_lp = padded(data["log_probs"], lengths).requires_grad_()
    adv = padded(data["adv"], lengths) if data["adv"].numel() == data["log_probs"].numel() else data["adv"]
    loss, metrics = policy_loss(
        variant, padded_lp, padded(data["old"], lengths), adv, padded(data["mask"].double(), lengths).bool(),
        agg="seq-mean-token-mean", clip_low=clip[0], clip_high=clip[1],
        rollout_weights=padded(data["weights"], lengths) if weights else None,
    )  # fmt: skip
    loss.backward()
    valid = torch.arange(padded_lp.shape[1]) < torch.tensor(lengths)[:, None]
    return loss, padded_lp.grad[valid], metrics["clip_frac_low"], metrics["clip_frac_high"]


def run_packed(data: dict, variant: str, clip: tuple[float, float], *, impl: str, weights: bool,
               dtype: torch.dtype = torch.float32):  # fmt: skip
    lp = data["log_probs"].to(DEVICE, dtype).requires_grad_()
    out = packed_gspo_loss(
        lp, data["old"].to(DEVICE, dtype), data["adv"].to(DEVICE, torch.float32), data["cu"].to(DEVICE),
        data["mask"].to(DEVICE), clip_low=clip[0], clip_high=clip[1], variant=variant,
        rollout_weights=data["weights"].to(DEVICE, torch.float32) if weights else None, impl=impl,
    )  # fmt: skip
    out.loss.backward()
    return out, lp.grad


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> str:
    if request.param == "triton":
        request.getfixturevalue("triton_gspo")
    return request.param


@pytest.mark.parametrize("variant", ["gspo", "gspo_token"])
@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize(("log_ratio_scale", "clip"), [(2e-4, (3e-4, 4e-4)), (0.3, (0.2, 0.28)), (40.0, (0.2, 0.2))])
def test_matches_policy_loss_on_padded_batch(
    impl: str, variant: str, per_token_adv: bool, weights: bool, log_ratio_scale: float, clip: tuple[float, float]
) -> None:
    data = make_packed(7, LENGTHS, per_token_adv=per_token_adv, log_ratio_scale=log_ratio_scale)
    data["log_probs"] = data["log_probs"].float().double()  # the packed path sees float32 inputs
    data["old"] = data["old"].float().double()
    out, grad = run_packed(data, variant, clip, impl=impl, weights=weights)
    loss, ref_grad, low, high = reference(data, variant, clip, weights)
    torch.testing.assert_close(out.loss.cpu().double(), loss, atol=2e-7, rtol=2e-6)
    torch.testing.assert_close(grad.cpu().double(), ref_grad, atol=1e-8, rtol=2e-5)
    torch.testing.assert_close(out.clip_frac_low.cpu().double(), low)
    torch.testing.assert_close(out.clip_frac_high.cpu().double(), high)


@pytest.mark.parametrize("variant", ["gspo", "gspo_token"])
def test_long_and_empty_sequences(impl: str, variant: str) -> None:
    """Sequences spanning several kernel blocks and an empty one (``cu_seqlens`` repeats an offset)."""
    data = make_packed(11, LONG_LENGTHS, per_token_adv=variant == "gspo_token", log_ratio_scale=0.2)
    data["log_probs"], data["old"] = data["log_probs"].float().double(), data["old"].float().double()
    out, grad = run_packed(data, variant, (3e-4, 4e-4), impl=impl, weights=True)
    loss, ref_grad, low, high = reference(data, variant, (3e-4, 4e-4), weights=True)
    torch.testing.assert_close(out.loss.cpu().double(), loss, atol=2e-7, rtol=2e-6)
    torch.testing.assert_close(grad.cpu().double(), ref_grad, atol=1e-9, rtol=2e-5)
    assert out.seq_ratio[1].item() == 1.0  # empty sequence: log-ratio 0
    assert float(low) + float(high) > 0  # the clip branch was exercised


def test_bf16_log_probs_match_float32(impl: str) -> None:
    """bf16 inputs are computed in float32: same loss as the float32 call on the rounded values, bf16 gradient."""
    data = make_packed(5, LENGTHS, per_token_adv=False, log_ratio_scale=0.3)
    data["log_probs"] = data["log_probs"].bfloat16().double()
    data["old"] = data["old"].bfloat16().double()
    out16, grad16 = run_packed(data, "gspo", (0.2, 0.28), impl=impl, weights=False, dtype=torch.bfloat16)
    out32, grad32 = run_packed(data, "gspo", (0.2, 0.28), impl=impl, weights=False)
    assert grad16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.loss, out32.loss, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(grad16.float(), grad32, atol=0, rtol=1e-2)


def test_triton_equals_torch_with_int32_offsets(triton_gspo: object) -> None:
    data = make_packed(9, LONG_LENGTHS, per_token_adv=False, log_ratio_scale=0.1)
    data["cu"] = data["cu"].int()
    results = [run_packed(data, "gspo", (0.05, 0.05), impl=name, weights=True) for name in IMPLS]
    (a, grad_a), (b, grad_b) = results
    torch.testing.assert_close(a.loss, b.loss, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(a.seq_ratio, b.seq_ratio, atol=0, rtol=1e-6)
    torch.testing.assert_close(grad_a, grad_b, atol=1e-10, rtol=1e-5)


def test_gspo_and_gspo_token_agree_for_sequence_advantages(impl: str) -> None:
    data = make_packed(3, LENGTHS, per_token_adv=False, log_ratio_scale=0.1)
    grads = [run_packed(data, variant, (3e-4, 4e-4), impl=impl, weights=False)[1] for variant in ("gspo", "gspo_token")]
    torch.testing.assert_close(grads[0], grads[1], atol=1e-8, rtol=1e-5)


def test_first_update_ratio_is_one(impl: str) -> None:
    """On-policy (new == old): every s_i is exactly 1, nothing is clipped, the gradient is -A_t w_t / (n_i S)."""
    data = make_packed(4, LENGTHS, per_token_adv=True, log_ratio_scale=0.0)
    out, grad = run_packed(data, "gspo_token", (3e-4, 4e-4), impl=impl, weights=False)
    assert torch.equal(out.seq_ratio.cpu(), torch.ones(len(LENGTHS)))
    assert float(out.clip_frac_low) == float(out.clip_frac_high) == 0.0
    lengths = torch.tensor(LENGTHS)
    seg = torch.repeat_interleave(torch.arange(len(LENGTHS)), lengths)
    n_valid = torch.zeros(len(LENGTHS)).index_add_(0, seg, data["mask"].float())
    expected = torch.where(data["mask"], -data["adv"].float() / (n_valid[seg].clamp(min=1) * (n_valid > 0).sum()), 0.0)
    torch.testing.assert_close(grad.cpu(), expected, atol=1e-9, rtol=1e-6)


def test_dispatcher_and_bad_arguments() -> None:
    assert resolve_gspo_impl("auto", torch.zeros(2)) == "torch"
    with pytest.raises(ValueError, match="impl must be one of"):
        resolve_gspo_impl("cuda", torch.zeros(2))  # type: ignore[arg-type]
    lp, cu = torch.zeros(6), torch.tensor([0, 2, 6])
    with pytest.raises(ValueError, match="cu_seqlens"):
        packed_gspo_loss(lp, lp, torch.zeros(2), torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="non-decreasing"):
        packed_gspo_loss(lp, lp, torch.zeros(2), torch.tensor([0, 7, 6]))
    with pytest.raises(ValueError, match="advantages"):
        packed_gspo_loss(lp, lp, torch.zeros(3), cu)
    with pytest.raises(ValueError, match="rollout_weights"):
        packed_gspo_loss(lp, lp, torch.zeros(2), cu, rollout_weights=torch.ones(5))
    with pytest.raises(ValueError, match="variant"):
        packed_gspo_loss(lp, lp, torch.zeros(2), cu, variant="ppo")  # type: ignore[arg-type]
