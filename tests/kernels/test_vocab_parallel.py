"""Tests for `megatron_rl.kernels.reference_logprob`: values and gradients against a float64 reference.

1. One process, unsplit vocabulary: fp32, bf16, temperature, padding, extreme logits.
2. Simulated tensor parallelism: the per-shard phases of the forward and backward are run shard by shard and
   combined by hand (max / sum) exactly as the two all-reduces do, for k = 1, 2, 4, 8 shards.
3. A real 2-rank gloo run under torchrun, also checked against megatron's `vocab_parallel_cross_entropy`.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.kernels import reference_logprob as vp
from megatron_rl.kernels.reference_logprob import token_logprobs_and_entropy
from tests.kernels.logprob_reference import reference

REPO_ROOT = Path(__file__).resolve().parents[2]
TP2_SCRIPT = Path(__file__).resolve().parent / "scripts" / "vocab_parallel_tp2.py"

# Outputs are fp32, so a log-prob near -20 cannot be closer than half an ulp (~1e-6) to the float64 value.
# Tolerance: 1e-6 absolute plus 2e-7 relative (~1.7 ulp). Measured worst cases against float64, fp32 inputs:
# log-probs 1.7e-6 at |log p| ~ 19 (0.9 ulp), entropy 7.6e-7, grads 5.5e-7 (V = 151936 included).
FP32_ATOL = 1e-6
FP32_RTOL = 2e-7
# bf16 inputs: log-probs and entropy are still fp32-accurate (measured 1.2e-6 / 7e-7 on the bf16 values);
# the gradient is returned in bf16 (8-bit mantissa), measured 5.2e-3 abs for |grad| up to ~3.
BF16_GRAD_ATOL = 1e-2


def make_case(
    shape: tuple[int, ...], vocab: int, *, seed: int, valid_vocab_size: int | None = None, scale: float = 3.0
) -> dict:
    """Random logits [*shape, vocab], targets among the valid columns and per-position loss weights."""
    gen = torch.Generator().manual_seed(seed)
    valid = vocab if valid_vocab_size is None else valid_vocab_size
    return {
        "logits": scale * torch.randn(*shape, vocab, generator=gen),
        "targets": torch.randint(0, valid, shape, generator=gen),
        "w_logprobs": torch.randn(*shape, generator=gen),
        "w_entropy": torch.randn(*shape, generator=gen),
        "valid_vocab_size": valid_vocab_size,
    }


def case_args(case: dict) -> dict:
    """The keyword arguments of `reference` held by a case."""
    return {k: case[k] for k in ("logits", "targets", "w_logprobs", "w_entropy", "valid_vocab_size")}


def run_single(case: dict, *, temperature: float = 1.0, dtype: torch.dtype = torch.float32) -> tuple:
    logits = case["logits"].to(dtype).requires_grad_()
    logprobs, entropy = token_logprobs_and_entropy(
        logits, case["targets"], valid_vocab_size=case["valid_vocab_size"], temperature=temperature
    )
    (case["w_logprobs"] * logprobs + case["w_entropy"] * entropy).sum().backward()
    return logprobs, entropy, logits.grad


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, atol: float = FP32_ATOL, rtol: float = FP32_RTOL
) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol)


# --- 1. single process ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("shape", [(6,), (2, 5), (2, 3, 2)])
def test_fp32_matches_float64_reference(shape: tuple[int, ...], temperature: float) -> None:
    case = make_case(shape, 1000, seed=1)
    logprobs, entropy, grad = run_single(case, temperature=temperature)
    ref_lp, ref_ent, ref_grad = reference(**case_args(case), temperature=temperature)
    assert logprobs.dtype == entropy.dtype == torch.float32 and logprobs.shape == shape
    assert_close(logprobs, ref_lp)
    assert_close(entropy, ref_ent)
    assert_close(grad, ref_grad)


def test_bf16_input_computes_in_fp32() -> None:
    case = make_case((4, 8), 4096, seed=2)
    case["logits"] = case["logits"].bfloat16().float()  # the reference sees exactly the bf16 values
    logprobs, entropy, grad = run_single(case, temperature=0.9, dtype=torch.bfloat16)
    ref_lp, ref_ent, ref_grad = reference(**case_args(case), temperature=0.9)
    assert logprobs.dtype == entropy.dtype == torch.float32 and grad.dtype == torch.bfloat16
    assert_close(logprobs, ref_lp)  # fp32 math on bf16 inputs: no bf16 rounding in the outputs
    assert_close(entropy, ref_ent)
    assert_close(grad, ref_grad, BF16_GRAD_ATOL)


def test_padded_columns_are_ignored_and_get_zero_grad() -> None:
    case = make_case((3, 4), 640, seed=3, valid_vocab_size=600)
    case["logits"][..., 600:] = 1e4  # padding must not win the softmax even when it holds the largest values
    logprobs, entropy, grad = run_single(case, temperature=1.3)
    ref_lp, ref_ent, ref_grad = reference(**case_args(case), temperature=1.3)
    assert_close(logprobs, ref_lp)
    assert_close(entropy, ref_ent)
    assert_close(grad, ref_grad)
    assert torch.equal(grad[..., 600:], torch.zeros_like(grad[..., 600:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_logits_stay_finite(dtype: torch.dtype) -> None:
    case = make_case((4, 3), 512, seed=4)
    logits = torch.where(case["logits"] > 0, 1e4, -1e4)
    logits[0, 0, 7] = 1e4 + 64  # one row with a single dominant token: entropy ~ 0
    case["logits"] = logits.to(dtype).float()  # the reference sees exactly the rounded values
    logprobs, entropy, grad = run_single(case, dtype=dtype)
    assert torch.isfinite(logprobs).all() and torch.isfinite(entropy).all() and torch.isfinite(grad).all()
    ref_lp, ref_ent, ref_grad = reference(**case_args(case))
    assert_close(logprobs, ref_lp)  # log p ~ -2e4 for the -1e4 tokens: 1 fp32 ulp there is 2e-3, within FP32_RTOL
    assert_close(entropy, ref_ent)
    assert_close(grad, ref_grad, FP32_ATOL if dtype == torch.float32 else BF16_GRAD_ATOL)


def test_without_entropy_and_single_output_grads() -> None:
    case = make_case((2, 7), 300, seed=5)
    logits = case["logits"].clone().requires_grad_()
    logprobs, entropy = token_logprobs_and_entropy(logits, case["targets"], with_entropy=False)
    assert entropy is None
    (case["w_logprobs"] * logprobs).sum().backward()
    _, _, ref_grad = reference(**{**case_args(case), "w_entropy": torch.zeros(2, 7)})
    assert_close(logits.grad, ref_grad)

    # Only the entropy feeds the loss: the log-prob output receives no gradient.
    logits.grad = None
    _, entropy = token_logprobs_and_entropy(logits, case["targets"])
    (case["w_entropy"] * entropy).sum().backward()
    _, _, ref_grad = reference(**{**case_args(case), "w_logprobs": torch.zeros(2, 7)})
    assert_close(logits.grad, ref_grad)


def test_explicit_vocab_start_index_without_group_scores_one_shard() -> None:
    """Without a group, a shard given its start index is scored as if it were the whole vocabulary."""
    case = make_case((3, 4), 128, seed=14)
    logits = case["logits"].requires_grad_()
    logprobs, entropy = token_logprobs_and_entropy(logits, case["targets"] + 384, vocab_start_index=384)
    (case["w_logprobs"] * logprobs + case["w_entropy"] * entropy).sum().backward()
    ref_lp, ref_ent, ref_grad = reference(**case_args(case))
    assert_close(logprobs, ref_lp)
    assert_close(entropy, ref_ent)
    assert_close(logits.grad, ref_grad)


def test_rejects_bad_arguments() -> None:
    logits, targets = torch.randn(2, 3, 10), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="targets shape"):
        token_logprobs_and_entropy(logits, targets[:, :2])
    with pytest.raises(TypeError, match="integer"):
        token_logprobs_and_entropy(logits, targets.float())
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_and_entropy(logits, targets, temperature=0.0)


# --- 2. simulated tensor parallelism -------------------------------------------------------------------------


def simulate_tp(case: dict, num_shards: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the forward/backward phases shard by shard; max and sum over shards stand in for the all-reduces."""
    shards = case["logits"].chunk(num_shards, dim=-1)
    vocab_local = shards[0].shape[-1]
    assert all(s.shape[-1] == vocab_local for s in shards), "the vocabulary must split evenly"
    starts = [r * vocab_local for r in range(num_shards)]
    valid, targets, w_logprobs, w_entropy = (
        case[k] for k in ("valid_vocab_size", "targets", "w_logprobs", "w_entropy")
    )

    padding = [vp._padding_columns(s, start, valid) for s, start in zip(shards, starts, strict=True)]
    masked = [vp._masked_fp32(s, pad) for s, pad in zip(shards, padding, strict=True)]
    row_max = torch.stack([z.amax(dim=-1) for z in masked]).amax(dim=0)  # all-reduce MAX
    stats = sum(  # all-reduce SUM
        vp._shard_stats(vp._shift_and_scale_(z, row_max, pad, temperature), targets, start, with_entropy=True)
        for z, pad, start in zip(masked, padding, starts, strict=True)
    )
    logprobs, entropy, log_sum_exp = vp._combine_stats(stats)
    grads = [
        vp._shard_grad(s, targets, row_max, log_sum_exp, entropy, w_logprobs, w_entropy, start, valid, temperature)
        for s, start in zip(shards, starts, strict=True)
    ]
    return logprobs, entropy, torch.cat(grads, dim=-1)


@pytest.mark.parametrize("num_shards", [1, 2, 4, 8])
@pytest.mark.parametrize(
    ("vocab", "valid_vocab_size", "temperature"),
    [
        (1024, None, 1.0),
        (1024, 1000, 0.8),  # the last shard is partly padding
        (1024, 700, 0.5),  # with 4 or 8 shards, the last shards are entirely padding
        (151936, 151665, 1.0),  # Qwen2.5's padded vocabulary
    ],
)
def test_simulated_shards_match_reference(
    num_shards: int, vocab: int, valid_vocab_size: int | None, temperature: float
) -> None:
    case = make_case((4,), vocab, seed=6, valid_vocab_size=valid_vocab_size)
    logprobs, entropy, grad = simulate_tp(case, num_shards, temperature)
    ref_lp, ref_ent, ref_grad = reference(**case_args(case), temperature=temperature)
    assert_close(logprobs, ref_lp)
    assert_close(entropy, ref_ent)
    assert_close(grad, ref_grad)
    if valid_vocab_size is not None:
        assert torch.equal(grad[..., valid_vocab_size:], torch.zeros_like(grad[..., valid_vocab_size:]))


def test_one_shard_simulation_equals_public_function() -> None:
    """Guards the simulation itself: with one shard it must reproduce the autograd Function bit for bit."""
    case = make_case((3, 5), 256, seed=7, valid_vocab_size=250)
    sim = simulate_tp(case, 1, 0.9)
    public = run_single(case, temperature=0.9)
    for a, b in zip(sim, public, strict=True):
        assert torch.equal(a, b)


# --- 3. real tensor parallelism: 2 ranks on gloo -------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.torchrun
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_tp2_gloo_matches_reference_and_megatron(tmp_path: Path) -> None:
    fp32 = {"dtype": torch.float32}
    cases = [
        {**make_case((2, 6), 512, seed=8), "temperature": 1.0, **fp32},
        {**make_case((2, 6), 512, seed=9), "temperature": 0.7, **fp32},
        {**make_case((3, 4), 512, seed=10, valid_vocab_size=400), "temperature": 1.2, **fp32},  # rank 1 part padding
        {**make_case((3, 4), 512, seed=11, valid_vocab_size=250), "temperature": 1.0, **fp32},  # rank 1 all padding
        {**make_case((4,), 151936, seed=12, valid_vocab_size=151665), "temperature": 1.0, **fp32},
        {**make_case((2, 5), 1024, seed=13), "temperature": 0.9, "dtype": torch.bfloat16},
    ]
    cases[-1]["logits"] = cases[-1]["logits"].bfloat16().float()  # the reference sees exactly the bf16 values
    inputs = tmp_path / "inputs.pt"
    torch.save(cases, inputs)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_port", str(_free_port()), str(TP2_SCRIPT), str(inputs), str(tmp_path)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert all(rank.pop("rejected_contradicting_vocab_start_index") for rank in ranks)
    ranks = [rank.pop("cases") for rank in ranks]
    for case, rank0, rank1 in zip(cases, *ranks, strict=True):
        ref_lp, ref_ent, ref_grad = reference(**case_args(case), temperature=case["temperature"])
        for key in ("logprobs", "entropy"):
            assert torch.equal(rank0[key], rank1[key]), f"{key} differs between ranks"
        assert_close(rank0["logprobs"], ref_lp)
        assert_close(rank0["entropy"], ref_ent)
        grad_atol = FP32_ATOL if case["dtype"] == torch.float32 else BF16_GRAD_ATOL
        assert_close(torch.cat([rank0["grad"], rank1["grad"]], dim=-1), ref_grad, grad_atol)
        if case["valid_vocab_size"] is None:
            # megatron: log p = -CE, and d(sum log p)/dz = onehot - softmax(z) for z = logits / T
            assert_close(rank0["megatron_logprobs"], rank0["logprobs"])
            z = (case["logits"].double() / case["temperature"]).requires_grad_()
            (ref_z_grad,) = torch.autograd.grad(
                torch.log_softmax(z, -1).gather(-1, case["targets"].unsqueeze(-1)).sum(), z
            )
            assert_close(torch.cat([rank0["megatron_grad"], rank1["megatron_grad"]], dim=-1), ref_z_grad)
