"""Tiny random Qwen2-MoE and Mixtral checkpoints with the character tokenizer, for the family tests (the demo's
Qwen3-MoE builder is `megatron_rl.tiny_model`)."""

from __future__ import annotations

from pathlib import Path

from megatron_rl.tiny_model import save_random_model


def make_tiny_qwen2_moe(out_dir: str | Path, *, seed: int = 0, tie_word_embeddings: bool = False) -> Path:
    """A tiny Qwen2-MoE (QKV bias, gated shared expert, one dense layer) with the character tokenizer."""
    config = dict(
        model_type="qwen2_moe",
        architectures=["Qwen2MoeForCausalLM"],
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_hidden_layers=3,
        mlp_only_layers=[2],
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        qkv_bias=True,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=0.05,
    )
    return save_random_model(out_dir, config, 128, seed, {"family": "qwen2_moe"})


def make_tiny_mixtral(out_dir: str | Path, *, seed: int = 0) -> Path:
    """A tiny Mixtral (all layers MoE, w1/w2/w3 experts) with the character tokenizer."""
    config = dict(
        model_type="mixtral",
        architectures=["MixtralForCausalLM"],
        vocab_size=128,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        rope_theta=1e6,
        sliding_window=None,
        initializer_range=0.05,
    )
    return save_random_model(out_dir, config, 128, seed, {"family": "mixtral"})
