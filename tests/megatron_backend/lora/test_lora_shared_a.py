"""An A shared by a MoE layer's routed experts (`model.lora.share_expert_a`), one process, fp32:

* One A per MoE layer for fc1 and one for fc2 (every expert's adapter uses it), each expert its own B.
* B = 0: the log-probs are the base's bitwise. B != 0: they equal transformers' on the merged weights, with the
  grouped and with the sequential experts.
* The peft export expands the shared A into every expert's rows of `lora_A`; peft loads it and scores like the
  trainer, and it loads back into a shared-A model; an adapter whose experts' A differ is refused.
* One update: the shared A's gradient is the sum over the experts of each expert's A gradient in a float64
  reference (`test_lora_grad_float64.float64_update` on the expanded adapters), within 1e-5.
* A checkpoint's run config carries the option to `convert lora-to-hf`; sharing without `experts` is refused.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from megatron_rl.config.options import LoRAOptions, ModelOptions
from tests.megatron_backend.actor.test_train_step_grad_vs_hf import _batch
from tests.megatron_backend.conftest import megatron_world  # noqa: F401 (the one-process Megatron world fixture)
from tests.megatron_backend.lora.test_lora_adapters import EXPERTS, PEFT_LORA, TOL, _actor, _hf_log_probs, _random_b
from tests.megatron_backend.lora.test_lora_grad_float64 import float64_update

pytestmark = pytest.mark.usefixtures("megatron_world")
SHARED = LoRAOptions(rank=4, alpha=16.0, targets=("attention", "experts"), share_expert_a=True)
MOE_LAYERS = 3


def _valid(batch) -> torch.Tensor:
    valid = torch.arange(batch.input_ids.shape[1]) < batch.lengths[:, None]
    valid[:, 0] = False
    return valid


def test_one_a_per_layer_and_zero_b_is_the_base_bitwise(tiny_moe_dir: Path) -> None:
    from megatron_rl.megatron_backend.lora.adapters import SharedExpertA, lora_modules

    base, shared, each = _actor(tiny_moe_dir, None), _actor(tiny_moe_dir, SHARED), _actor(tiny_moe_dir, PEFT_LORA)
    holders = [m for m in shared.chunks[0].modules() if isinstance(m, SharedExpertA)]
    assert len(holders) == MOE_LAYERS
    experts = [lora for lora in lora_modules(shared.chunks) if lora.expert]
    assert len(experts) == MOE_LAYERS * 2 * EXPERTS
    assert {id(lora.A[0]) for lora in experts} == {id(p) for h in holders for p in (h.fc1, h.fc2)}

    def count(actor) -> int:
        return sum(p.numel() for p in actor.chunks[0].parameters() if p.requires_grad)

    spec = shared.dims
    saved = MOE_LAYERS * (EXPERTS - 1) * SHARED.rank * (spec.hidden_size + spec.moe_ffn_hidden_size)
    assert count(each) - count(shared) == saved
    batch = _batch()
    want = base.compute_log_probs(batch).log_probs
    assert torch.equal(shared.compute_log_probs(batch).log_probs, want)


@pytest.mark.parametrize("experts", ["grouped", "sequential"])
def test_nonzero_b_equals_the_merged_weights(tiny_moe_dir: Path, tmp_path: Path, experts: str) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    actor = _actor(tiny_moe_dir, SHARED, model_options=ModelOptions(experts=experts))
    built = type(actor.chunks[0].decoder.layers[0].mlp.experts).__name__
    assert built == {"grouped": "GroupedSequentialMLP", "sequential": "SequentialMLP"}[experts]
    base = _actor(tiny_moe_dir, None).compute_log_probs(_batch()).log_probs
    _random_b(actor)
    batch = _batch()
    got = actor.compute_log_probs(batch).log_probs.double()
    assert (got - base).abs().max() > 1e-2
    merged = tmp_path / "merged"
    shutil.copytree(tiny_moe_dir, merged)
    save_file({name: t for bucket in actor.export_hf() for name, t in bucket}, str(merged / "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    assert (_hf_log_probs(hf, batch) - got)[_valid(batch)].abs().max() < TOL


def test_the_peft_export_expands_the_shared_a_and_loads_back(tiny_moe_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megatron_rl.megatron_backend.lora.peft_format import load_peft_adapter, save_peft_adapter

    actor = _actor(tiny_moe_dir, SHARED)
    _random_b(actor)
    batch = _batch()
    got = actor.compute_log_probs(batch).log_probs
    save_peft_adapter(actor.chunks, SHARED, EXPERTS, tmp_path / "shared", str(tiny_moe_dir))
    state = load_file(tmp_path / "shared" / "adapter_model.safetensors")
    experts_a = [v for k, v in state.items() if ".experts" in k and ".lora_A." in k]
    assert len(experts_a) == 2 * MOE_LAYERS
    for a in experts_a:  # [E·r, in]: every expert's rows are the shared A
        per_expert = a.reshape(EXPERTS, SHARED.rank, -1)
        assert torch.equal(per_expert, per_expert[:1].expand_as(per_expert))
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32),
                                           tmp_path / "shared")  # fmt: skip
    assert (_hf_log_probs(peft_model, batch) - got.double())[_valid(batch)].abs().max() < TOL

    fresh = _actor(tiny_moe_dir, SHARED)
    load_peft_adapter(fresh.chunks, SHARED, EXPERTS, tmp_path / "shared")
    assert torch.equal(fresh.compute_log_probs(batch).log_probs, got)

    each = _actor(tiny_moe_dir, PEFT_LORA)  # an adapter per expert: the experts' A differ
    save_peft_adapter(each.chunks, PEFT_LORA, EXPERTS, tmp_path / "each", str(tiny_moe_dir))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.* has a different lora_A per expert, but "
                                         r"model.lora.share_expert_a shares one"):  # fmt: skip
        load_peft_adapter(fresh.chunks, SHARED, EXPERTS, tmp_path / "each")


def test_the_shared_a_gradient_is_the_sum_of_the_experts_in_float64(tiny_moe_dir: Path) -> None:
    update = float64_update(tiny_moe_dir, SHARED)
    assert abs(update.loss - update.want_loss) <= 1e-5 * abs(update.want_loss)
    shared = [k for k in update.grads if ".experts" in k and ".lora_A." in k]
    assert len(shared) == 2 * MOE_LAYERS and update.grads.keys() == update.want_grads.keys()
    for name, want_grad in update.want_grads.items():
        if name in shared:  # d/dA of Σ_e B_e A x_e: the experts' A gradients summed, in every expert's rows
            want_grad = want_grad.reshape(EXPERTS, SHARED.rank, -1).sum(0).repeat(EXPERTS, 1)
        err = float((update.grads[name].double() - want_grad).norm()) / float(want_grad.norm())
        assert err <= 1e-5, f"{name}: |Δgrad| / |grad| = {err:.3g}"


def test_a_checkpoint_names_the_option_and_sharing_without_experts_is_refused(tiny_moe_dir: Path, tmp_path: Path):
    from megatron_rl.megatron_backend.lora.checkpoint import lora_run

    step = tmp_path / "run" / "checkpoints" / "step_000000002"
    step.mkdir(parents=True)
    (tmp_path / "run" / "config.yaml").write_text(
        f"model:\n  hf_path: {tiny_moe_dir}\n  lora:\n    rank: 4\n    share_expert_a: true\n"
    )
    run = lora_run(step)  # what `megatron-rl convert lora-to-hf` builds the model with
    assert run is not None and run.lora.share_expert_a and run.lora.rank == 4
    with pytest.raises(ValueError, match="model.lora.share_expert_a shares the routed experts' A, but"):
        _actor(tiny_moe_dir, LoRAOptions(rank=4, targets=("attention",), share_expert_a=True))
