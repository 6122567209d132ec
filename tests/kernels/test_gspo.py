"""Packed GSPO / GSPO-token loss against ``policy_loss(..., agg="seq-mean-token-mean")`` on the padded batch."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algorithms.policy_losses import policy_loss
from megatron_rl.kernels import packed_gspo_loss

LENGTHS = [5, 9, 3, 7, 1, 4]


def make_packed(seed: int, *, per_token_adv: bool, log_ratio_scale: float) -> dict:
    gen = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    old = -3 * torch.rand(total, generator=gen, dtype=torch.float64)
    new = old + log_ratio_scale * torch.randn(total, generator=gen, dtype=torch.float64)
    mask = torch.rand(total, generator=gen) > 0.2
    mask[sum(LENGTHS[:4]) : sum(LENGTHS[:5])] = False  # one sequence with no valid token
    adv = torch.randn(total if per_token_adv else len(LENGTHS), generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    return {"log_probs": new.float(), "old": old.float(), "adv": adv.float(), "cu": cu, "mask": mask}


def padded(values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(list(values.split(LENGTHS)), batch_first=True, padding_value=fill)


@pytest.mark.parametrize("variant", ["gspo", "gspo_token"])
@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize(("log_ratio_scale", "clip"), [(2e-4, (3e-4, 4e-4)), (0.3, (0.2, 0.28)), (40.0, (0.2, 0.2))])
def test_matches_policy_loss_on_padded_batch(
    variant: str, per_token_adv: bool, log_ratio_scale: float, clip: tuple[float, float]
) -> None:
    data = make_packed(7, per_token_adv=per_token_adv, log_ratio_scale=log_ratio_scale)
    packed_lp = data["log_probs"].clone().requires_grad_()
    out = packed_gspo_loss(packed_lp, data["old"], data["adv"], data["cu"], data["mask"],
                           clip_low=clip[0], clip_high=clip[1], variant=variant)  # fmt: skip
    out.loss.backward()

    padded_lp = padded(data["log_probs"]).requires_grad_()
    adv = padded(data["adv"]) if per_token_adv else data["adv"]
    loss, metrics = policy_loss(variant, padded_lp, padded(data["old"]), adv, padded(data["mask"].float()).bool(),
                                agg="seq-mean-token-mean", clip_low=clip[0], clip_high=clip[1])  # fmt: skip
    loss.backward()
    lengths = torch.tensor(LENGTHS)
    valid = torch.arange(padded_lp.shape[1]) < lengths[:, None]
    torch.testing.assert_close(out.loss, loss, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(packed_lp.grad, padded_lp.grad[valid], atol=1e-8, rtol=1e-5)
    torch.testing.assert_close(out.clip_frac_low, metrics["clip_frac_low"])
    torch.testing.assert_close(out.clip_frac_high, metrics["clip_frac_high"])


def test_gspo_and_gspo_token_agree_for_sequence_advantages() -> None:
    data = make_packed(3, per_token_adv=False, log_ratio_scale=0.1)
    grads = []
    for variant in ("gspo", "gspo_token"):
        lp = data["log_probs"].clone().requires_grad_()
        out = packed_gspo_loss(lp, data["old"], data["adv"], data["cu"], data["mask"], variant=variant)
        out.loss.backward()
        grads.append(lp.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-8, rtol=1e-5)


def test_rejects_bad_arguments() -> None:
    lp, cu = torch.zeros(6), torch.tensor([0, 2, 6])
    with pytest.raises(ValueError, match="cu_seqlens"):
        packed_gspo_loss(lp, lp, torch.zeros(2), torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="advantages"):
        packed_gspo_loss(lp, lp, torch.zeros(3), cu)
    with pytest.raises(ValueError, match="variant"):
        packed_gspo_loss(lp, lp, torch.zeros(2), cu, variant="ppo")  # type: ignore[arg-type]
