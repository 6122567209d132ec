"""The trainer's RL loss with the packed GSPO kernels (``algo.gspo_kernel``) equals the reference ``policy_loss``
path on a right-padded micro-batch: loss, count, gradient and every metric."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rl.config import ConfigError, load_config
from megatron_rl.config.algo import AlgoConfig
from megatron_rl.megatron_backend.actor.batch import TokenBatch
from megatron_rl.trainer.step.rl_loss import build_rl_loss, gspo_kernel
from tests.kernels.conftest import DEVICE, triton_gspo  # noqa: F401 (fixture used by name)


def micro_batch(seed: int) -> TokenBatch:
    gen = torch.Generator().manual_seed(seed)
    b, s = 6, 40
    lengths = torch.tensor([40, 31, 12, 25, 40, 1])
    response_start = torch.tensor([5, 9, 12, 3, 20, 1])  # row 2 and the padding row 5 have no response token
    pos = torch.arange(s)
    mask = ((pos >= response_start[:, None]) & (pos < lengths[:, None])).float()
    old = -3 * torch.rand(b, s, generator=gen)
    adv = torch.randn(b, 1, generator=gen).expand(b, s).contiguous()
    return TokenBatch(
        input_ids=torch.randint(0, 100, (b, s), generator=gen),
        lengths=lengths,
        response_start=response_start,
        fields={
            "loss_mask": mask,
            "old_log_probs": old,
            "advantages": adv,
            "rollout_log_probs": old + 0.05 * torch.randn(b, s, generator=gen),
            "ref_log_probs": old + 0.1 * torch.randn(b, s, generator=gen),
        },
        padding_rows=1,
    )


def gspo_algo(**changes: object) -> AlgoConfig:
    algo = load_config(None, ["model.hf_path=unused", "algo.preset=gspo"]).algo
    return dataclasses.replace(algo, **changes)


def run(algo: AlgoConfig, mb: TokenBatch, log_probs: torch.Tensor):
    lp = log_probs.to(DEVICE).requires_grad_()
    loss_sum, count, metrics = build_rl_loss(algo)(lp, None, mb)
    loss_sum.backward()
    return float(loss_sum), int(count), metrics, lp.grad.cpu()


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("loss", ["gspo", "gspo_token"])
@pytest.mark.parametrize("extra", [{}, {"rollout_correction": "tis", "kl_coef": 0.01}], ids=["plain", "tis+kl"])
def test_packed_kernel_equals_reference(kernel: str, loss: str, extra: dict, request: pytest.FixtureRequest) -> None:
    if kernel == "triton":
        request.getfixturevalue("triton_gspo")
    mb = micro_batch(1)
    gen = torch.Generator().manual_seed(2)
    log_probs = mb.fields["old_log_probs"] + 5e-3 * torch.randn(mb.input_ids.shape, generator=gen)
    ref = run(gspo_algo(loss=loss, gspo_kernel="reference", **extra), mb, log_probs)
    got = run(gspo_algo(loss=loss, gspo_kernel=kernel, **extra), mb, log_probs)
    assert got[1] == ref[1] == 4  # non-empty sequences
    assert got[0] == pytest.approx(ref[0], rel=1e-6, abs=1e-9)
    torch.testing.assert_close(got[3], ref[3], atol=1e-9, rtol=1e-5)
    assert got[2].keys() == ref[2].keys()
    for key, value in ref[2].items():
        assert got[2][key] == pytest.approx(value, rel=1e-5, abs=1e-9), key
    assert ref[2]["actor/clip_frac_low"] + ref[2]["actor/clip_frac_high"] > 0  # clipping was exercised


def test_first_update_is_exactly_on_policy_with_the_packed_kernel() -> None:
    mb = micro_batch(3)
    _, _, metrics, _ = run(gspo_algo(gspo_kernel="torch"), mb, mb.fields["old_log_probs"].clone())
    assert metrics["actor/ppo_kl"] == 0.0
    assert metrics["actor/ratio_min"] == metrics["actor/ratio_max"] == 1.0


def test_auto_is_reference_on_cpu_and_explicit_kernels_need_gspo() -> None:
    assert gspo_kernel(gspo_algo(), torch.zeros(2, 2)) == "reference"
    assert gspo_kernel(gspo_algo(gspo_kernel="torch"), torch.zeros(2, 2)) == "torch"
    with pytest.raises(ConfigError, match="algo.gspo_kernel='triton' computes loss=gspo/gspo_token"):
        load_config(None, ["model.hf_path=unused", "algo.preset=grpo", "algo.gspo_kernel=triton"])
