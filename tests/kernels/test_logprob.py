"""Chunked-torch and Triton log-prob/entropy kernels against a float64 oracle and the reference implementation.

The same file runs the Triton kernels compiled on a GPU and under ``TRITON_INTERPRET=1`` on CPU (see
``conftest.py``; the mode is printed in the test header via ``test_report_triton_mode``).

1. Whole vocabulary in one process: fp32/bf16, temperature, padding, ``-inf`` logits, several blocks, 151,936.
2. Simulated tensor parallelism (1-8 shards): per-shard stats, stacked in place of the all-gather, combined.
3. A real 2-rank gloo run (torchrun) of both implementations.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from megatron_rl.kernels import resolve_impl, token_logprobs_and_entropy
from megatron_rl.kernels.chunked_logprob import shard_grad, shard_stats
from megatron_rl.kernels.reference_logprob import token_logprobs_and_entropy as vp_reference
from megatron_rl.kernels.shard_stats import combine_shard_stats, valid_local_columns
from tests.kernels.conftest import DEVICE, triton_mode
from tests.kernels.logprob_reference import make_case, reference

SCRIPT = Path(__file__).resolve().parent / "scripts" / "logprob_tp2.py"

# Against float64 with fp32 math: 1e-6 absolute + 1e-6 relative (a log-prob near -20 is only fp32-exact to
# ~1e-6). bf16 inputs: outputs still fp32-accurate; the bf16 gradient is within ~1 bf16 ulp of |grad| <= 3.
FP32 = {"atol": 1e-6, "rtol": 1e-6}
BF16_GRAD = {"atol": 1e-2, "rtol": 1e-2}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: dict = FP32) -> None:
    torch.testing.assert_close(actual.detach().double().cpu(), expected.double().cpu(), **tol)


def run(case: dict, impl: str, dtype: torch.dtype, temperature: float, **kwargs: object) -> tuple:
    logits = case["logits"].to(DEVICE, dtype, copy=True).requires_grad_()
    targets = case["targets"].to(DEVICE)
    logprobs, entropy = token_logprobs_and_entropy(
        logits, targets, valid_vocab_size=case["valid_vocab_size"], temperature=temperature, impl=impl, **kwargs
    )
    loss = (case["w_logprobs"].to(DEVICE) * logprobs + case["w_entropy"].to(DEVICE) * entropy).sum()
    loss.backward()
    return logprobs, entropy, logits.grad


CASES = {
    "fp32": ((2, 8), 1000, {}, torch.float32, 1.0),
    "fp32-T0.7-padded": ((3, 4), 1024, {"valid_vocab_size": 1000}, torch.float32, 0.7),
    "fp32-inf-scattered": ((2, 8), 1000, {"masked_fraction": 0.3}, torch.float32, 1.3),
    "fp32-inf-tail": ((2, 8), 1000, {"masked_tail": 300}, torch.float32, 1.0),
    "bf16": ((2, 8), 4096, {}, torch.bfloat16, 0.9),
    "fp32-several-blocks": ((4,), 32768, {}, torch.float32, 1.0),
    "bf16-qwen-vocab": ((3,), 151936, {"valid_vocab_size": 151665}, torch.bfloat16, 1.0),
}


def _check(case: dict, dtype: torch.dtype, temperature: float, outputs: tuple) -> None:
    if dtype != torch.float32:
        case = {**case, "logits": case["logits"].to(dtype).float()}  # the oracle sees exactly the rounded values
    keys = ("logits", "targets", "w_logprobs", "w_entropy", "valid_vocab_size")
    ref_lp, ref_ent, ref_grad = reference(**{k: case[k] for k in keys}, temperature=temperature)
    logprobs, entropy, grad = outputs
    assert logprobs.dtype == entropy.dtype == torch.float32 and grad.dtype == dtype
    assert_close(logprobs, ref_lp)
    assert_close(entropy, ref_ent)
    assert_close(grad, ref_grad, FP32 if dtype == torch.float32 else BF16_GRAD)
    assert torch.isfinite(grad).all()
    if case["valid_vocab_size"] is not None:
        assert not grad[..., case["valid_vocab_size"] :].any()


# --- 1. whole vocabulary ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_chunked_matches_oracle(name: str) -> None:
    shape, vocab, opts, dtype, temperature = CASES[name]
    case = make_case(shape, vocab, seed=1, **opts)
    _check(case, dtype, temperature, run(case, "chunked", dtype, temperature, chunk_rows=3))


@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_oracle(name: str, triton_kernels: object) -> None:
    shape, vocab, opts, dtype, temperature = CASES[name]
    case = make_case(shape, vocab, seed=1, **opts)
    _check(case, dtype, temperature, run(case, "triton", dtype, temperature))


def test_chunked_equals_reference_implementation() -> None:
    """Without -inf logits the chunked path reproduces kernels.reference_logprob to fp32 rounding."""
    case = make_case((5, 7), 2000, seed=2, valid_vocab_size=1900)
    ours = run(case, "chunked", torch.float32, 0.8, chunk_rows=4)
    theirs = run(case, "torch", torch.float32, 0.8)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_dispatcher() -> None:
    cpu_logits = torch.randn(2, 10)
    assert resolve_impl("auto", cpu_logits) == "chunked"
    with pytest.raises(ValueError, match="impl"):
        resolve_impl("cuda", cpu_logits)  # type: ignore[arg-type]
    targets = torch.zeros(2, dtype=torch.long)
    logprobs, entropy = token_logprobs_and_entropy(cpu_logits, targets, with_entropy=False)
    assert entropy is None and logprobs.shape == (2,)
    with pytest.raises(ValueError, match="targets shape"):
        token_logprobs_and_entropy(cpu_logits, targets[:1])
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_and_entropy(cpu_logits, targets, temperature=0.0)


def test_single_output_gradients(triton_kernels: object) -> None:
    case = make_case((2, 5), 700, seed=3)
    for impl in ("chunked", "triton"):
        for keep in ("logprobs", "entropy"):
            logits = case["logits"].to(DEVICE, copy=True).requires_grad_()
            lp, ent = token_logprobs_and_entropy(logits, case["targets"].to(DEVICE), impl=impl)
            weights = case["w_logprobs"] if keep == "logprobs" else case["w_entropy"]
            ((lp if keep == "logprobs" else ent) * weights.to(DEVICE)).sum().backward()
            zero = torch.zeros(2, 5)
            w_lp, w_h = (weights, zero) if keep == "logprobs" else (zero, weights)
            _, _, ref_grad = reference(case["logits"], case["targets"], w_lp, w_h)
            assert_close(logits.grad, ref_grad)


# --- 2. simulated tensor parallelism ---------------------------------------------------------------------------


def simulate_tp(case: dict, num_shards: int, dtype: torch.dtype, temperature: float, stats_fn, grad_fn) -> tuple:
    """Per-shard stats -> stack (the all-gather) -> combine -> per-shard gradient, one process."""
    logits = case["logits"].to(DEVICE, dtype)
    shards = logits.reshape(-1, logits.shape[-1]).chunk(num_shards, dim=-1)  # non-contiguous views
    targets = case["targets"].reshape(-1).to(DEVICE)
    vocab_local = shards[0].shape[-1]
    n_valid = [valid_local_columns(vocab_local, r * vocab_local, case["valid_vocab_size"]) for r in range(num_shards)]
    stats = torch.stack([
        stats_fn(s, targets, vocab_start_index=r * vocab_local, n_valid=n_valid[r], temperature=temperature)
        for r, s in enumerate(shards)
    ])  # fmt: skip
    row_stats = combine_shard_stats(stats, temperature)
    g_lp, g_h = case["w_logprobs"].reshape(-1).to(DEVICE), case["w_entropy"].reshape(-1).to(DEVICE)
    grads = [
        grad_fn(s, targets, row_stats, g_lp, g_h, vocab_start_index=r * vocab_local, n_valid=n_valid[r],
                temperature=temperature)
        for r, s in enumerate(shards)
    ]  # fmt: skip
    shape = case["targets"].shape
    return row_stats.logprobs.view(shape), row_stats.entropy.view(shape), torch.cat(grads, -1).view(logits.shape)


TP_CASES = {
    "plain": ((4,), 1024, {}, torch.float32, 1.0, (1, 2, 4, 8)),
    "padding-whole-shards": ((4,), 1024, {"valid_vocab_size": 700}, torch.float32, 0.5, (2, 4, 8)),
    "inf-whole-shard": ((2, 8), 1000, {"masked_tail": 300}, torch.float32, 1.0, (4,)),
    "bf16": ((2, 8), 1000, {"masked_fraction": 0.1}, torch.bfloat16, 1.0, (2,)),
    "qwen-tp8-bf16": ((2,), 151936, {"valid_vocab_size": 151665}, torch.bfloat16, 1.0, (8,)),
}


@pytest.mark.parametrize("impl", ["chunked", "triton"])
@pytest.mark.parametrize("name", list(TP_CASES))
def test_simulated_tp(name: str, impl: str, request: pytest.FixtureRequest) -> None:
    shape, vocab, opts, dtype, temperature, sizes = TP_CASES[name]
    if impl == "triton":
        kernels = request.getfixturevalue("triton_kernels")
        stats_fn, grad_fn = kernels.triton_shard_stats, kernels.triton_shard_grad
    else:
        stats_fn = lambda *a, **k: shard_stats(*a, chunk_rows=3, **k)  # noqa: E731
        grad_fn = lambda *a, **k: shard_grad(*a, chunk_rows=3, **k)  # noqa: E731
    case = make_case(shape, vocab, seed=4, **opts)
    for num_shards in sizes:
        _check(case, dtype, temperature, simulate_tp(case, num_shards, dtype, temperature, stats_fn, grad_fn))


def test_report_triton_mode(triton_kernels: object, capsys: pytest.CaptureFixture) -> None:
    """Records in the output whether the Triton tests ran compiled or interpreted, and checks that it is so."""
    with capsys.disabled():
        print(f"\n[kernels] Triton tests ran in {triton_mode()} mode on {DEVICE}")
    assert (os.environ.get("TRITON_INTERPRET") == "1") == (triton_mode() == "interpreter")


def test_reference_implementation_gives_nan_for_inf_logits() -> None:
    """Documents why ``-inf`` support matters: the existing reference returns NaN entropy for ``-inf`` logits."""
    case = make_case((2,), 100, seed=5, masked_tail=10)
    _, entropy = vp_reference(case["logits"], case["targets"])
    _, ours = token_logprobs_and_entropy(case["logits"], case["targets"], impl="chunked")
    assert torch.isnan(entropy).all() and torch.isfinite(ours).all()


def test_matches_transformer_engine_parallel_cross_entropy(triton_kernels: object) -> None:
    """On a GPU with Transformer Engine: log-probs and their gradient equal ``-parallel_cross_entropy`` (TP=1)."""
    if DEVICE.type != "cuda":
        pytest.skip("Transformer Engine runs on CUDA only (cross-check runs in scripts/gpu_check.sh)")
    try:  # a broken TE install raises RuntimeError/OSError, not ImportError
        from transformer_engine.pytorch import parallel_cross_entropy
    except Exception as err:  # noqa: BLE001
        pytest.skip(f"transformer_engine.pytorch does not import: {err}")
    case = make_case((4, 300), 151_936, seed=8)
    targets, weights = case["targets"].to(DEVICE), case["w_logprobs"].to(DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        results = []
        for name in ("triton", "te"):
            logits = case["logits"].to(DEVICE, dtype, copy=True).requires_grad_()
            if name == "te":  # per-token loss; TE may return it in the input dtype
                te_loss = parallel_cross_entropy(logits, targets, 0.0, False, None)
                te_dtype, logprobs = te_loss.dtype, -te_loss.float()
            else:
                logprobs = token_logprobs_and_entropy(logits, targets, with_entropy=False, impl="triton")[0]
            (weights * logprobs).sum().backward()
            results.append((logprobs, logits.grad.float()))
        (ours, ours_grad), (te, te_grad) = results
        assert_close(ours, te, FP32 if te_dtype == torch.float32 else BF16_GRAD)
        assert_close(ours_grad, te_grad, FP32 if dtype == torch.float32 else BF16_GRAD)


# --- 3. real tensor parallelism: 2 ranks on gloo -------------------------------------------------------------


@pytest.mark.torchrun
def test_tp2_gloo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from tests.dist_harness import run_torchrun

    impls = ["chunked"] + (["triton"] if importlib.util.find_spec("triton") else [])
    cases = [
        {**make_case((2, 6), 512, seed=8), "temperature": 1.0, "dtype": torch.float32},
        {**make_case((3, 4), 512, seed=9, valid_vocab_size=250), "temperature": 0.7, "dtype": torch.float32},
        {**make_case((2, 5), 1000, seed=10, masked_tail=500), "temperature": 1.0, "dtype": torch.float32},
        {**make_case((2, 5), 1024, seed=11), "temperature": 0.9, "dtype": torch.bfloat16},
    ]
    inputs = tmp_path / "inputs.pt"
    torch.save({"cases": cases, "impls": impls}, inputs)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the ranks run on CPU tensors
    run_torchrun(SCRIPT, 2, [str(inputs), str(tmp_path)], timeout=180)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for impl in impls:
        for i, case in enumerate(cases):
            rank0, rank1 = ranks[0][impl][i], ranks[1][impl][i]
            for key in ("logprobs", "entropy"):
                assert torch.equal(rank0[key], rank1[key]), f"{impl}: {key} differs between ranks"
            grad = torch.cat([rank0["grad"], rank1["grad"]], dim=-1)
            _check(case, case["dtype"], case["temperature"], (rank0["logprobs"], rank0["entropy"], grad))
