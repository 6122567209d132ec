"""Tiny GLM-4.5 checkpoints for the family tests, built by transformers' own `Glm4MoeForCausalLM`.

`FULL` exercises every option the family translates: partial RoPE (0.5, GLM's value), QKV bias, QK-norm,
group-limited routing (4 groups of 2 experts, the best 2 groups; top-4 // 2 groups = the top-2 group score both
sides use), routed scaling 2.5, two shared experts, a dense first layer, head_dim (16) != hidden / heads (12).
`AIR_LIKE` is shaped like GLM-4.5-Air's config: no QK-norm, one group, scaling 1, one shared expert, and a
different rotary share (0.25) so a wrong `rotary_percent` shows.
The router's `e_score_correction_bias` is zero in a fresh model: it gets random values before saving, and so do
the norms (ones) and the router (sharpened), so a dropped bias or a swapped norm cannot go unnoticed.
"""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(
    vocab_size=128,
    hidden_size=48,
    intermediate_size=80,
    moe_intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=4,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    attention_bias=True,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
FULL = dict(
    COMMON,
    use_qk_norm=True,
    partial_rotary_factor=0.5,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    n_shared_experts=2,
)
AIR_LIKE = dict(
    COMMON,
    use_qk_norm=False,
    partial_rotary_factor=0.25,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
    n_shared_experts=1,
)


def make_tiny_glm4_moe(out_dir: Path, config: dict, *, seed: int = 0) -> Path:
    """Save a randomly initialised tiny GLM-4.5 (safetensors, fp32) with the character tokenizer to `out_dir`.

    Its config.json declares one MTP layer (`num_nextn_predict_layers`, transformers' default, as the released
    checkpoints do); `tests/models/mtp_layer.add_mtp_layer` adds its tensors."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    from megatron_rl.tiny_model import build_char_tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = Glm4MoeForCausalLM(Glm4MoeConfig(**config))
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("norm.weight") or "layernorm" in name:
                tensor.copy_(1.0 + 0.1 * torch.randn_like(tensor))
            elif name.endswith("mlp.gate.weight"):
                tensor.normal_(0.0, 0.5)  # a router with clear preferences
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(0.3 * torch.randn_like(tensor))
            elif name.endswith("bias"):
                tensor.normal_(0.0, 0.1)
    model.save_pretrained(out_dir)
    build_char_tokenizer(config["vocab_size"]).save_pretrained(out_dir)
    return out_dir
