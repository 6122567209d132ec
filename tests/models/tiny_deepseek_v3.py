"""Tiny DeepSeek-V3 checkpoints built by transformers itself (test support).

Two models exercise every option the family translates: Multi-Latent Attention with a query latent and YaRN
(mscale != mscale_all_dim), and without one (Moonlight's `q_lora_rank=None`) with plain RoPE and an rms_norm_eps
far from the latent norms' fixed 1e-6 (Moonlight: 1e-5; 1e-2 makes a mix-up visible: 0.7 in log-prob); both with
a dense first layer, v_head_dim != the query/key head width, a sigmoid router whose score-correction bias is non-zero,
group-limited top-k (4 groups, 2 kept, top-4: 4 // 2 == 2 as Megatron requires), routed_scaling_factor 2.5 and
a shared expert. The MTP layer a DeepSeek-V3 checkpoint may carry is added by
`tests/models/mtp_layer.add_mtp_layer`.
"""

from __future__ import annotations

from pathlib import Path

import torch

SHAPES = dict(
    vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=12, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
    routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1, max_position_embeddings=256,
    tie_word_embeddings=False,
)  # fmt: skip
# The runs pair these models with the tiny char tokenizer (megatron_rl.tiny_model): the config's special-token ids
# must be its ids, as the trainer's tokenizer guard checks (DeepseekV3Config's defaults are bos 0, eos 1).
CHAR_TOKENIZER_IDS = dict(bos_token_id=None, eos_token_id=2, pad_token_id=3)
YARN = dict(
    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, beta_fast=32.0,
    beta_slow=1.0, mscale=0.8, mscale_all_dim=0.7,
)  # fmt: skip


def build_tiny_deepseek_v3(path: Path, *, q_lora_rank: int | None, seed: int = 0) -> Path:
    """Save a tiny DeepSeek-V3 (fp32 safetensors) at `path`: q_lora_rank 24 with YaRN, or None with plain RoPE.

    Weights are drawn wider than transformers' initialisation (std 0.2, norms around 1) so routing and attention
    are far from uniform; the router's score-correction bias is set after building, as a trained model has it."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    rope = YARN if q_lora_rank else dict(rope_type="default", rope_theta=50000.0)
    eps = 1e-6 if q_lora_rank else 1e-2
    config = DeepseekV3Config(
        **SHAPES, q_lora_rank=q_lora_rank, rope_parameters=rope, rms_norm_eps=eps, **CHAR_TOKENIZER_IDS
    )
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(1 + 0.1 * torch.randn_like(param) if param.dim() == 1 else 0.2 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
    model.save_pretrained(path)
    return path
