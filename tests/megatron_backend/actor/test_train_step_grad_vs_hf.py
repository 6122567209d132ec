"""One `MegatronActor.train_step` with the trainer's RL loss computes the gradient transformers' autograd gives.

A real actor (one process, gloo, TP=1, fp32) takes one step on a batch split into several micro-batches, with
the trainer's loss (`build_rl_loss`: PPO clip, k3 KL, entropy bonus, TIS). The reference is the same HF
checkpoint in transformers: its log-probs and entropies of the same tokens, the float64 hand loss of
`tests/trainer/rl_loss_by_hand.py` on them, and autograd back to every weight. The actor's gradient is read
from Megatron's grad buffers after the step (no clipping, so they hold the gradient of the global loss).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rl.megatron_backend.actor.batch import TokenBatch, split_by_token_budget
from megatron_rl.trainer.step.rl_loss import build_rl_loss
from tests.megatron_backend.conftest import megatron_world  # noqa: F401 (the one-process Megatron world fixture)
from tests.trainer.rl_loss_by_hand import PRESET_OF, hand_step, rl_algo

MICRO_BATCH_TOKENS = 48  # 3 micro-batches of 2 samples
# Both sides run the model in fp32 with different kernels and summation orders, so they agree to fp32
# rounding accumulated over 4 layers and 3 micro-batches: measured, the loss to 1.4e-7 and every weight's
# gradient to 1.8e-6 (relative, in norm). The bounds leave 7x and 11x of margin; the mutants the tests guard
# against (KL sign, Dr. GRPO normaliser) move the loss or the gradient by 1e-2 or more.
LOSS_RTOL, GRAD_RTOL = 1e-6, 2e-5


def _batch(initial_log_probs: torch.Tensor | None = None) -> TokenBatch:
    gen = torch.Generator().manual_seed(5)
    b, s = 6, 20
    lengths = torch.tensor([20, 13, 17, 9, 20, 15])
    starts = torch.tensor([3, 5, 2, 4, 8, 6])
    ids = torch.randint(4, 100, (b, s), generator=gen)
    for i in range(b):
        ids[i, lengths[i] :] = 3
    batch = TokenBatch(ids, lengths, starts)
    if initial_log_probs is not None:
        mask = batch.response_mask()
        mask[3] = False  # a sample excluded from the loss

        def near(scale: float) -> torch.Tensor:
            return initial_log_probs + scale * torch.randn(b, s, generator=gen)

        old = near(0.3)
        batch.fields.update(
            loss_mask=mask.float(),
            old_log_probs=old,
            advantages=torch.randn(b, 1, generator=gen).expand(b, s).contiguous(),
            rollout_log_probs=old + 0.5 * torch.randn(b, s, generator=gen),
            ref_log_probs=near(0.3),
        )
    return batch


def _hf_scores(model, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies in the actor's layout (position t: token t given ids[:t]; 0 elsewhere), each
    sample run alone and unpadded, differentiable w.r.t. the HF weights."""
    b, s = batch.input_ids.shape
    log_probs, entropy = [], []
    for i in range(b):
        n = int(batch.lengths[i])
        ids = batch.input_ids[i, :n]
        logp_all = torch.log_softmax(model(ids.unsqueeze(0)).logits[0].double(), -1)[:-1]
        lp = logp_all.gather(-1, ids[1:, None]).squeeze(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
        log_probs.append(torch.nn.functional.pad(lp, (1, s - n)))
        entropy.append(torch.nn.functional.pad(ent, (1, s - n)))
    return torch.stack(log_probs), torch.stack(entropy)


def _by_checkpoint_name(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors of the transformers model under the checkpoint's names: transformers >= 5 fuses each MoE
    layer's experts into `experts.gate_up_proj` [E, 2I, H] (gate rows first) and `experts.down_proj` [E, H, I]."""
    out = {}
    for name, tensor in named.items():
        prefix, _, last = name.rpartition(".")
        if last == "gate_up_proj":
            for e, (gate, up) in enumerate(t.chunk(2, dim=0) for t in tensor):
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate, up
        elif last == "down_proj" and prefix.endswith(".experts"):
            out.update((f"{prefix}.{e}.down_proj.weight", t) for e, t in enumerate(tensor))
        else:
            out[name] = tensor
    return out


def _megatron_grads_as_hf(actor) -> dict[str, torch.Tensor]:
    """The actor's accumulated gradients, renamed and reshaped to HF tensors by the family's weight map."""
    from megatron_rl.megatron_backend.weights.hf_weights import local_params

    weights = actor.family.weight_map(actor.hf_config)
    builder = weights.hf_tensor_builder(actor.dims.vocab_size)  # cuts Megatron's vocabulary padding
    out = {}
    for item in local_params(actor.modules, weights):
        out.update(builder.add(weights.rule(item.global_name), item.param.main_grad.detach()))
    return out


@pytest.mark.usefixtures("megatron_world")
@pytest.mark.parametrize("agg", sorted(PRESET_OF))
def test_train_step_gradient_equals_transformers_autograd(tiny_moe_dir: Path, agg: str) -> None:
    from safetensors.torch import load_file
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
    assert len(split_by_token_budget(_batch().lengths.tolist(), MICRO_BATCH_TOKENS)) == 3
    batch = _batch(actor.compute_log_probs(_batch()).log_probs)
    metrics = actor.train_step(batch, build_rl_loss(rl_algo(agg, "token")), with_entropy=True)
    got = _megatron_grads_as_hf(actor)

    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32)
    log_probs, entropy = _hf_scores(model, batch)
    want = hand_step(agg, "token", batch.fields, log_probs.detach(), entropy.detach())
    torch.autograd.backward([log_probs, entropy], [want.grad_log_probs, want.grad_entropy])
    expected = _by_checkpoint_name({name: p.grad for name, p in model.named_parameters()})
    checkpoint = load_file(tiny_moe_dir / "model.safetensors")
    weights = _by_checkpoint_name(dict(model.named_parameters()))
    assert weights.keys() == checkpoint.keys()
    assert all(torch.equal(weights[n], checkpoint[n]) for n in checkpoint)  # the renaming is the checkpoint's

    assert want.truncated > 0 and want.clipped > 0  # TIS truncation and the PPO clip are exercised
    assert metrics["count"] == want.count
    assert metrics["loss"] == pytest.approx(want.loss, rel=LOSS_RTOL)
    assert got.keys() == expected.keys()
    # Every kind of weight is reached: embedding, attention, router, an expert, the dense MLP, the output layer.
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.experts.0.up_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "lm_head.weight",
    ):
        assert expected[name].norm() > 0, name
    for name, want_grad in expected.items():
        err = float((got[name] - want_grad).norm())
        assert err <= GRAD_RTOL * float(want_grad.norm()), (
            f"{name}: |Δgrad| {err:.3g}, |grad| {float(want_grad.norm()):.3g}"
        )
