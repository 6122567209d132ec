"""Top-k distillation's kernels (`kernels.topk_logprob`) against float64 log-softmax of the full vocabulary, on one
rank and with the vocabulary split over two ranks under torchrun; and eq. (3) against a hand computation."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from megatron_rl.algorithms.distillation import topk_kl
from megatron_rl.kernels import next_token_logprobs_and_entropy
from megatron_rl.kernels.topk_logprob import next_token_logprobs_at, next_token_topk
from tests.dist_harness import run_torchrun

SCRIPT = Path(__file__).resolve().parent / "scripts" / "topk_tp2.py"


def make_case(seed: int = 0, b: int = 2, s: int = 7, vocab: int = 64, valid: int = 60, k: int = 5) -> dict:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, s, vocab, generator=g) * 3
    logits[..., valid:] = 9.0  # padding columns of a padded vocabulary: large, but never a real token
    return {
        "logits": logits,
        "input_ids": torch.randint(0, valid, (b, s), generator=g),
        "ids": torch.randint(0, valid, (b, s, k), generator=g),
        "weights": torch.randn(b, s, k, generator=g),
        "valid": valid,
        "k": k,
    }


def expected(case: dict) -> dict:
    """float64 log-softmax over the real vocabulary, position t from logits t-1."""
    x = case["logits"].double()[:, :-1, : case["valid"]].clone().requires_grad_()
    full = torch.log_softmax(x, dim=-1)
    at = full.gather(-1, case["ids"][:, 1:])
    (case["weights"][:, 1:].double() * at).sum().backward()
    grad = torch.zeros_like(case["logits"], dtype=torch.float64)
    grad[:, :-1, : case["valid"]] = x.grad
    top_logp, top_ids = full.detach().topk(case["k"], dim=-1)
    return {"at": at.detach(), "grad": grad, "top_ids": top_ids, "top_logp": top_logp}


def check(case: dict, out: dict) -> None:
    want = expected(case)
    assert torch.equal(out["at"][:, 0], torch.zeros_like(out["at"][:, 0]))
    assert torch.equal(out["top_ids"][:, 0], torch.zeros_like(out["top_ids"][:, 0]))
    torch.testing.assert_close(out["at"][:, 1:].double(), want["at"], atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(out["grad"].double(), want["grad"], atol=2e-6, rtol=1e-6)
    assert torch.equal(out["top_ids"][:, 1:], want["top_ids"])
    torch.testing.assert_close(out["top_logp"][:, 1:].double(), want["top_logp"], atol=2e-6, rtol=1e-6)


def test_kernels_on_one_rank_equal_float64_log_softmax():
    case = make_case()
    logits = case["logits"].clone().requires_grad_()
    logp, _ = next_token_logprobs_and_entropy(
        logits, case["input_ids"], valid_vocab_size=case["valid"], with_entropy=False
    )
    at = next_token_logprobs_at(logits, case["input_ids"], logp, case["ids"])
    (case["weights"] * at).sum().backward()
    top_ids, top_logp = next_token_topk(
        logits.detach(), case["input_ids"], logp.detach(), case["k"], valid_vocab_size=case["valid"]
    )
    check(case, {"at": at.detach(), "grad": logits.grad, "top_ids": top_ids, "top_logp": top_logp})


def test_kernels_with_the_vocabulary_split_over_two_ranks_equal_one_rank(tmp_path):
    case = make_case(seed=1, vocab=64, valid=50)  # rank 1's shard holds the padding columns
    torch.save(case, tmp_path / "inputs.pt")
    run_torchrun(SCRIPT, 2, [str(tmp_path / "inputs.pt"), str(tmp_path)], timeout=180)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for key in ("top_ids", "top_logp", "at"):
        assert torch.equal(ranks[0][key], ranks[1][key]), f"{key} differs between ranks"
    check(case, {**ranks[0], "grad": torch.cat([ranks[0]["grad"], ranks[1]["grad"]], dim=-1)})


def test_topk_kl_equals_a_hand_computation():
    teacher = torch.tensor([[[math.log(0.5), math.log(0.3), math.log(0.1)]]], dtype=torch.float64)
    student = torch.tensor([[[math.log(0.2), math.log(0.2), math.log(0.4)]]], dtype=torch.float64)
    # teacher renormalised over its 3 ids: 0.5/0.9, 0.3/0.9, 0.1/0.9
    p = [0.5 / 0.9, 0.3 / 0.9, 0.1 / 0.9]
    q = [0.2, 0.2, 0.4]
    want = sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q, strict=True))
    assert abs(float(topk_kl(teacher, student)) - want) < 1e-12
    # the student equal to the renormalised teacher on the ids: 0; putting mass outside them costs log(1/mass)
    renormalised = torch.log(torch.tensor([[p]], dtype=torch.float64))
    assert abs(float(topk_kl(teacher, renormalised))) < 1e-12
    assert abs(float(topk_kl(teacher, renormalised + math.log(0.5))) - math.log(2)) < 1e-12
