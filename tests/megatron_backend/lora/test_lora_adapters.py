"""LoRA adapters on the Megatron actor (`model.lora`, `megatron_backend/lora`), one process, fp32, against
transformers and peft:

* B = 0 (the start): the adapted actor's log-probs are the base's, bitwise; with the adapters off, too.
* B != 0: they differ from the base and equal transformers' scores of the merged weights the actor exports (the
  weights a rollout engine receives), and of the base checkpoint with the exported peft adapter loaded by peft.
* The exported adapter has exactly the names and shapes peft gives the transformers model (q/k/v/o_proj modules,
  the routed experts as `target_parameters`).
* One RL update: only the adapters move (the base gets no gradient and the optimizer holds only adapters), and the
  loss and every adapter's gradient equal autograd through the peft model (fp32; the loss by hand in float64).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_rl.config.options import LoRAOptions, OptimizerOptions
from megatron_rl.megatron_backend.actor.batch import TokenBatch
from megatron_rl.tiny_model import TinyQwen3MoeSpec
from tests.megatron_backend.actor.test_train_step_grad_vs_hf import GRAD_RTOL, LOSS_RTOL, MICRO_BATCH_TOKENS, _batch
from tests.megatron_backend.conftest import megatron_world  # noqa: F401 (the one-process Megatron world fixture)
from tests.trainer.rl_loss_by_hand import hand_step, rl_algo

pytestmark = pytest.mark.usefixtures("megatron_world")
LORA = LoRAOptions(rank=4, alpha=16.0)
# peft on transformers 5 maps gate_proj/up_proj/down_proj to the fused experts: the tests that load into peft leave
# the dense layer's MLP out (the export refuses it, `test_a_dense_mlp_adapter_beside_experts_is_refused_for_peft`)
PEFT_LORA = LoRAOptions(rank=4, alpha=16.0, targets=("attention", "experts"))
TOL = 1e-5  # fp32 trainer vs fp32/float64 transformers, as tests/trainer/test_distill_step.py
EXPERTS = TinyQwen3MoeSpec().num_experts


def _actor(model_dir: Path, lora: LoRAOptions | None = LORA, **kwargs):
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
    from megatron_rl.parallel_layout import ParallelLayout

    return MegatronActor.from_hf(model_dir, ParallelLayout(), lora=lora, **kwargs)


def _random_b(actor, seed: int = 0, std: float = 0.05) -> None:
    from megatron_rl.megatron_backend.lora.adapters import lora_modules

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lora in lora_modules(actor.chunks):
            for b in lora.B:
                b.copy_(torch.randn(b.shape, generator=gen) * std)


def _hf_log_probs(model, batch: TokenBatch) -> torch.Tensor:
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float64)
    with torch.no_grad():
        for i in range(batch.size):
            n = int(batch.lengths[i])
            ids = batch.input_ids[i, :n]
            logp = torch.log_softmax(model(ids.unsqueeze(0)).logits[0].double(), -1)[:-1]
            out[i, 1:n] = logp.gather(-1, ids[1:, None]).squeeze(-1)
    return out


def _peft_reference(model_dir: Path):
    """A fresh peft LoRA of the transformers model (peft's own names and shapes for these targets)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = LoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])  # fmt: skip
    return get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), config)


def test_zero_b_is_the_base_bitwise_and_adapters_off_too(tiny_moe_dir: Path) -> None:
    from megatron_rl.megatron_backend.lora.adapters import adapters_off, lora_modules

    base, adapted = _actor(tiny_moe_dir, None), _actor(tiny_moe_dir)
    batch = _batch()
    want = base.compute_log_probs(batch).log_probs
    assert torch.equal(adapted.compute_log_probs(batch).log_probs, want)
    # 4 layers (qkv, proj), 3 MoE layers (fc1 and fc2 of each expert) and one dense layer (fc1, fc2)
    assert len(list(lora_modules(adapted.chunks))) == 4 * 2 + 3 * 2 * EXPERTS + 2
    _random_b(adapted)
    moved = adapted.compute_log_probs(batch).log_probs
    assert (moved - want).abs().max() > 1e-2
    with adapters_off(adapted.chunks):
        assert torch.equal(adapted.compute_log_probs(batch).log_probs, want)


def test_nonzero_b_equals_the_merged_export_and_the_peft_adapter(tiny_moe_dir: Path, tmp_path: Path) -> None:
    import shutil

    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from megatron_rl.megatron_backend.lora.peft_format import save_peft_adapter

    actor = _actor(tiny_moe_dir, PEFT_LORA)
    _random_b(actor)
    batch = _batch()
    got = actor.compute_log_probs(batch).log_probs.double()
    valid = batch.response_mask() | (torch.arange(batch.input_ids.shape[1]) < batch.lengths[:, None])
    valid[:, 0] = False

    merged = tmp_path / "merged"
    shutil.copytree(tiny_moe_dir, merged)
    save_file({name: t for bucket in actor.export_hf() for name, t in bucket}, str(merged / "model.safetensors"))
    base = load_file(tiny_moe_dir / "model.safetensors")
    exported = load_file(merged / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(exported[q], base[q])
    assert torch.equal(exported["model.layers.0.mlp.gate.weight"], base["model.layers.0.mlp.gate.weight"])  # router
    hf_merged = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    assert (_hf_log_probs(hf_merged, batch) - got)[valid].abs().max() < TOL

    adapter = tmp_path / "adapter"
    save_peft_adapter(actor.chunks, PEFT_LORA, EXPERTS, adapter, str(tiny_moe_dir))
    want = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(_peft_reference(tiny_moe_dir)).items()}
    assert {k: tuple(v.shape) for k, v in load_file(adapter / "adapter_model.safetensors").items()} == want
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == LORA.rank and config["lora_alpha"] == LORA.alpha
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32),
                                           adapter)  # fmt: skip
    assert (_hf_log_probs(peft_model, batch) - got)[valid].abs().max() < TOL


def test_one_update_trains_only_the_adapters_with_peft_autograd_gradients(tiny_moe_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megatron_rl.megatron_backend.lora.peft_format import peft_state_dict, save_peft_adapter
    from megatron_rl.trainer.step.rl_loss import build_rl_loss
    from tests.megatron_backend.actor.test_train_step_grad_vs_hf import _hf_scores

    actor = _actor(tiny_moe_dir, PEFT_LORA, optimizer_options=OptimizerOptions(lr=1e-3, clip_grad=0.0,
                   distributed_optimizer=False), micro_batch_tokens=MICRO_BATCH_TOKENS)  # fmt: skip
    _random_b(actor)
    save_peft_adapter(actor.chunks, PEFT_LORA, EXPERTS, tmp_path / "adapter", str(tiny_moe_dir))
    trained = [p for c in actor.chunks for p in c.parameters() if p.requires_grad]
    assert trained and all(".lora." in n for c in actor.chunks for n, p in c.named_parameters() if p.requires_grad)
    in_optimizer = {id(p) for g in actor.optimizer.param_groups for p in g["params"]}
    assert len(in_optimizer) == len(trained)
    base_before = {n: p.detach().clone() for c in actor.chunks for n, p in c.named_parameters() if not p.requires_grad}

    batch = _batch(actor.compute_log_probs(_batch()).log_probs)
    metrics = actor.train_step(batch, build_rl_loss(rl_algo("token-mean", "token")), with_entropy=True)
    got = peft_state_dict(actor.chunks, EXPERTS, value=lambda p: p.main_grad)
    assert all(torch.equal(p, base_before[n]) for c in actor.chunks for n, p in c.named_parameters()
               if not p.requires_grad)  # fmt: skip

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32),
                                      tmp_path / "adapter", is_trainable=True)  # fmt: skip
    log_probs, entropy = _hf_scores(model, batch)
    want = hand_step("token-mean", "token", batch.fields, log_probs.detach(), entropy.detach())
    torch.autograd.backward([log_probs, entropy], [want.grad_log_probs, want.grad_entropy])
    expected = {n.replace(".default", ""): p.grad for n, p in model.named_parameters() if "lora_" in n}
    assert metrics["loss"] == pytest.approx(want.loss, rel=LOSS_RTOL)
    assert got is not None and got.keys() == expected.keys()
    for name, want_grad in expected.items():
        assert float(want_grad.norm()) > 0, name  # every adapter is reached (B != 0 lets A's gradient flow)
        err = float((got[name].double() - want_grad).norm())
        assert err <= GRAD_RTOL * float(want_grad.norm()), f"{name}: |Δgrad| {err:.3g}, |grad| {want_grad.norm():.3g}"


def test_a_dense_mlp_adapter_beside_experts_is_refused_for_peft(tiny_moe_dir: Path, tmp_path: Path) -> None:
    from megatron_rl.megatron_backend.lora.peft_format import save_peft_adapter

    with pytest.raises(ValueError, match="peft maps the names gate_proj/up_proj/down_proj to the fused experts"):
        save_peft_adapter(_actor(tiny_moe_dir).chunks, LORA, EXPERTS, tmp_path / "adapter", str(tiny_moe_dir))
