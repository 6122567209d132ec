"""Checkpoint-named tensors (per-expert, Mixtral w1/w2/w3) land in transformers 5's fused expert parameters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from megatron_rl.rollout.engines.hf_weight_loading import HFWeightLoader, WeightUpdateError
from tests.models.tiny_moe_decoders import make_tiny_mixtral, make_tiny_qwen2_moe


@pytest.mark.parametrize("make", [make_tiny_mixtral, make_tiny_qwen2_moe], ids=["mixtral", "qwen2_moe"])
def test_checkpoint_names_reproduce_the_loaded_model(make, tmp_path: Path):
    source = make(tmp_path / "a", seed=1)
    expected = AutoModelForCausalLM.from_pretrained(source)
    target = AutoModelForCausalLM.from_pretrained(make(tmp_path / "b", seed=2))
    tensors = list(load_file(source / "model.safetensors").items())
    touched = HFWeightLoader(target).load(tensors)
    assert touched == set(dict(target.named_parameters()))  # every parameter, fused experts included
    for (name, want), (_, got) in zip(expected.state_dict().items(), target.state_dict().items(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


def test_a_bad_tensor_rejects_the_whole_bucket(tmp_path: Path):
    model = AutoModelForCausalLM.from_pretrained(make_tiny_mixtral(tmp_path / "m", seed=1))
    before = model.model.embed_tokens.weight.clone()
    bucket = [
        ("model.embed_tokens.weight", torch.zeros_like(before)),
        ("model.layers.0.block_sparse_moe.experts.1.w3.weight", torch.zeros(32, 65)),
    ]
    with pytest.raises(WeightUpdateError, match=r"w3.weight.*\(32, 65\).*gate_up_proj slot expects \(32, 64\)"):
        HFWeightLoader(model).load(bucket)
    assert torch.equal(model.model.embed_tokens.weight, before)
