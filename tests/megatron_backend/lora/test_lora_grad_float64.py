"""One LoRA update of the Megatron actor (one process, fp32) against a float64 reference built by hand: the
transformers model in float64 computing with `W + (α/r) · B A` for every adapted weight, A and B autograd leaves
(no peft), and the trainer's loss written out in float64 (`tests/trainer/rl_loss_by_hand.py`).

Adapters on attention, the dense layer's MLP and every routed expert, B != 0 so that A's gradient flows too. The
actor's loss and each adapter's gradient (read from Megatron's grad buffers, in peft's layout) match the reference
within 1e-5: the loss relative to its value, each gradient both relative to its norm and in every element
(absolute). Measured: loss 4e-8 relative; gradients 1.6e-6 relative in norm at worst, 1.7e-7 absolute at worst
(the largest entries are 0.16). fp32 Megatron suffices; no float64 Megatron model is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from megatron_rl.config.options import LoRAOptions, OptimizerOptions
from tests.megatron_backend.actor.test_train_step_grad_vs_hf import MICRO_BATCH_TOKENS, _batch, _hf_scores
from tests.megatron_backend.conftest import megatron_world  # noqa: F401 (the one-process Megatron world fixture)
from tests.megatron_backend.lora.test_lora_adapters import EXPERTS, _actor, _random_b
from tests.trainer.rl_loss_by_hand import hand_step, rl_algo

pytestmark = pytest.mark.usefixtures("megatron_world")
LORA = LoRAOptions(rank=4, alpha=16.0, targets=("attention", "mlp", "experts"))
TOL = 1e-5


def merged_float64(model: torch.nn.Module, adapters: dict[str, torch.Tensor], scale: float) -> Callable:
    """`model` (float64) as a function of `adapters` (peft's names and layout): each adapted weight replaced by
    `W + scale · B A`; routed experts' A `[E·r, in]` and B `[out, r·E]` per expert e as A[e·r:(e+1)·r] and
    B[:, e::E] (peft's `ParamWrapper`), on transformers' fused `gate_up_proj` / `down_proj`."""
    from torch.func import functional_call

    params = dict(model.named_parameters())
    weights = {}
    for key, a in adapters.items():
        if ".lora_A." not in key:
            continue
        b = adapters[key.replace(".lora_A.", ".lora_B.")]
        module = key.removeprefix("base_model.model.").split(".lora_A.")[0]
        if module.endswith(".experts") or module.endswith(".experts.base_layer"):
            name = module.removesuffix(".base_layer") + (".gate_up_proj" if "base_layer" in module else ".down_proj")
            experts = params[name].shape[0]
            per_a = a.reshape(experts, -1, a.shape[1])  # [E, r, in]
            per_b = b.reshape(b.shape[0], -1, experts).permute(2, 0, 1)  # [E, out, r]
            delta = per_b @ per_a
        else:
            name, delta = f"{module}.weight", b @ a
        weights[name] = params[name] + scale * delta
    assert len(weights) == len(adapters) // 2
    return lambda ids: functional_call(model, weights, (ids,))


@dataclass
class Float64Update:
    loss: float  # the actor's
    want_loss: float  # the reference's
    grads: dict[str, torch.Tensor]  # the actor's adapter gradients, in peft's names and layout
    want_grads: dict[str, torch.Tensor]  # the reference's, likewise


def float64_update(model_dir: Path, lora: LoRAOptions) -> Float64Update:
    """One RL update of the actor with adapters `lora` (B drawn != 0), and the same update through
    `merged_float64` from the adapters it started with."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.megatron_backend.lora.peft_format import peft_state_dict
    from megatron_rl.trainer.step.rl_loss import build_rl_loss

    actor = _actor(model_dir, lora, optimizer_options=OptimizerOptions(lr=1e-3, clip_grad=0.0,
                   distributed_optimizer=False), micro_batch_tokens=MICRO_BATCH_TOKENS)  # fmt: skip
    _random_b(actor)
    values = peft_state_dict(actor.chunks, EXPERTS, value=lambda p: p.detach().clone())  # the step updates p
    batch = _batch(actor.compute_log_probs(_batch()).log_probs)
    metrics = actor.train_step(batch, build_rl_loss(rl_algo("token-mean", "token")), with_entropy=True)
    got = peft_state_dict(actor.chunks, EXPERTS, value=lambda p: p.main_grad)
    assert values is not None and got is not None

    leaves = {k: v.double().requires_grad_() for k, v in values.items()}
    eager = {"experts_implementation": "eager"}  # torch's grouped_mm has no float64
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, **eager)
    log_probs, entropy = _hf_scores(merged_float64(model, leaves, lora.alpha / lora.rank), batch)
    want = hand_step("token-mean", "token", batch.fields, log_probs.detach(), entropy.detach())
    torch.autograd.backward([log_probs, entropy], [want.grad_log_probs, want.grad_entropy])
    assert all(leaf.grad is not None for leaf in leaves.values())
    return Float64Update(metrics["loss"], want.loss, got, {k: leaf.grad for k, leaf in leaves.items()})


def test_one_lora_update_equals_a_float64_hand_built_reference(tiny_moe_dir: Path) -> None:
    update = float64_update(tiny_moe_dir, LORA)
    assert abs(update.loss - update.want_loss) <= TOL * abs(update.want_loss), (update.loss, update.want_loss)
    # q, k, v, o on 4 layers; gate, up, down on the dense one; gate_up and down of 3 MoE layers: A and B each
    assert update.grads.keys() == update.want_grads.keys() and len(update.grads) == 2 * (4 * 4 + 3 + 3 * 2)
    for name, want_grad in update.want_grads.items():
        assert float(want_grad.norm()) > 0, name  # every adapter is reached
        diff = update.grads[name].double() - want_grad
        rel = float(diff.norm()) / float(want_grad.norm())
        assert rel <= TOL and float(diff.abs().max()) <= TOL, f"{name}: |Δgrad| / |grad| = {rel:.3g}"
