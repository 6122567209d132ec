"""Top-k distillation's loss term (`algo.distill.top_k`, `algorithms.distillation` eq. 3) inside one
`MegatronActor.train_step`: the step's loss, its `distill/topk_kl` and every weight's gradient equal transformers'
float64 autograd of the same RL loss plus `top_k_coef` x KL(teacher's top-k renormalised || student at those ids).

The student's log-probs at the teacher's ids come from the actor's vocab-parallel logits through the loss contract's
`topk_log_probs` (`kernels.topk_logprob`); the teacher's ids are drawn over the whole vocabulary, so ids outside
the sampled tokens' columns are gathered too.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_rl.algorithms.distillation import topk_kl
from megatron_rl.config.algo import DistillConfig
from megatron_rl.megatron_backend.actor.batch import TokenBatch
from megatron_rl.trainer.step.rl_loss import build_rl_loss
from tests.megatron_backend.actor.test_train_step_grad_vs_hf import (
    GRAD_RTOL,
    LOSS_RTOL,
    MICRO_BATCH_TOKENS,
    _batch,
    _by_checkpoint_name,
    _megatron_grads_as_hf,
)
from tests.megatron_backend.conftest import megatron_world  # noqa: F401 (the one-process Megatron world fixture)
from tests.trainer.rl_loss_by_hand import hand_step, rl_algo

TOP_K, TOP_K_COEF = 4, 0.7


def _teacher_topk(batch: TokenBatch, vocab: int) -> None:
    """Random teacher top-k ids over the whole vocabulary and log-probs (as a teacher returns them)."""
    gen = torch.Generator().manual_seed(11)
    b, s = batch.input_ids.shape
    ids = torch.stack([torch.randperm(vocab, generator=gen)[:TOP_K] for _ in range(b * s)]).view(b, s, TOP_K)
    logp = -torch.rand(b, s, TOP_K, generator=gen).mul(4).sort(-1).values  # likeliest first
    batch.fields.update(teacher_topk_ids=ids, teacher_topk_log_probs=logp)


def _hf_full_log_probs(model, batch: TokenBatch) -> list[torch.Tensor]:
    """Per sample: float64 log-softmax `[n - 1, V]` of positions 1..n-1, differentiable w.r.t. the HF weights."""
    out = []
    for i in range(batch.size):
        n = int(batch.lengths[i])
        out.append(torch.log_softmax(model(batch.input_ids[i, :n].unsqueeze(0)).logits[0].double(), -1)[:-1])
    return out


@pytest.mark.usefixtures("megatron_world")
def test_topk_distillation_step_equals_transformers_autograd(tiny_moe_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from megatron_rl.config.options import OptimizerOptions
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
    from megatron_rl.parallel_layout import ParallelLayout

    actor = MegatronActor.from_hf(
        tiny_moe_dir,
        ParallelLayout(),
        optimizer_options=OptimizerOptions(lr=1e-3, clip_grad=0.0, distributed_optimizer=False),
        micro_batch_tokens=MICRO_BATCH_TOKENS,
    )
    batch = _batch(actor.compute_log_probs(_batch()).log_probs)
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32)
    _teacher_topk(batch, model.config.vocab_size)
    algo = rl_algo("token-mean", "token")
    algo = dataclasses.replace(
        algo, distill=DistillConfig(teacher="unused", served_by="local_engine", top_k=TOP_K, top_k_coef=TOP_K_COEF)
    )
    metrics = actor.train_step(batch, build_rl_loss(algo), with_entropy=True)
    got = _megatron_grads_as_hf(actor)

    # float64 reference: the RL loss by hand plus eq. (3) on transformers' log-softmax, token-mean over the mask.
    full = _hf_full_log_probs(model, batch)
    b, s = batch.input_ids.shape
    pad = [torch.nn.functional.pad(f, (0, 0, 1, s - 1 - f.shape[0])) for f in full]
    log_probs = torch.stack([p.gather(-1, batch.input_ids[i, :, None]).squeeze(-1) for i, p in enumerate(pad)])
    entropy = torch.stack([-(p.exp() * p).sum(-1) for p in pad])
    at_ids = torch.stack([p.gather(-1, batch.fields["teacher_topk_ids"][i]) for i, p in enumerate(pad)])
    mask = batch.fields["loss_mask"] > 0
    kl = topk_kl(batch.fields["teacher_topk_log_probs"].double(), at_ids)
    topk_loss = kl[mask].mean()
    want = hand_step("token-mean", "token", batch.fields, log_probs.detach(), entropy.detach())
    torch.autograd.backward(
        [log_probs, entropy, TOP_K_COEF * topk_loss], [want.grad_log_probs, want.grad_entropy, None]
    )
    expected = _by_checkpoint_name({name: p.grad for name, p in model.named_parameters()})

    assert float(topk_loss.detach()) > 0.5  # a teacher far from the student: the term moves the loss
    assert metrics["distill/topk_kl"] == pytest.approx(float(topk_loss), rel=LOSS_RTOL)
    assert metrics["loss"] == pytest.approx(want.loss + TOP_K_COEF * float(topk_loss), rel=LOSS_RTOL)
    assert got.keys() == expected.keys()
    for name, want_grad in expected.items():
        err = float((got[name] - want_grad).norm())
        assert err <= GRAD_RTOL * float(want_grad.norm()), (
            f"{name}: |Δgrad| {err:.3g}, |grad| {float(want_grad.norm()):.3g}"
        )


@pytest.mark.usefixtures("megatron_world")
def test_a_teacher_id_beyond_the_students_vocabulary_is_refused(tiny_moe_dir: Path) -> None:
    """A teacher with more embedding rows than the student could name an id the student has no logit for: the
    gather would read padding; the step stops naming the id instead."""
    from megatron_rl.config.options import OptimizerOptions
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
    from megatron_rl.parallel_layout import ParallelLayout

    actor = MegatronActor.from_hf(tiny_moe_dir, ParallelLayout(), micro_batch_tokens=MICRO_BATCH_TOKENS,
                                  optimizer_options=OptimizerOptions(distributed_optimizer=False))  # fmt: skip
    batch = _batch(actor.compute_log_probs(_batch()).log_probs)
    _teacher_topk(batch, actor.dims.vocab_size)
    batch.fields["teacher_topk_ids"][0, 5, 0] = actor.dims.vocab_size + 3
    algo = dataclasses.replace(rl_algo("token-mean", "token"), distill=DistillConfig(teacher="unused", top_k=TOP_K))
    with pytest.raises(ValueError, match=f"names token id {actor.dims.vocab_size + 3}, beyond the student's"):
        actor.warmup_step(batch, build_rl_loss(algo), lr=0.0)
