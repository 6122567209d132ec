"""A tiny GPT-OSS built and saved by transformers, exercising every option the gpt_oss family translates.

Attention sinks, sliding window on layers 0 and 2 (shorter than most test sequences), attention and router biases,
YaRN with an untruncated correction range, the clamped SwiGLU with a gain other than 1.702 and a limit small enough
to clamp, and fused expert tensors with non-square shapes ([E, 48, 80], [E, 40, 48]) so that a transposed or
de-interleaved mapping cannot fit by accident.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SLIDING_WINDOW = 8  # the family tests' samples are 8 to 29 tokens long


def tiny_gpt_oss_config(**overrides: Any) -> Any:
    """The tiny `GptOssConfig`; `overrides` replace its fields."""
    from transformers import GptOssConfig

    fields: dict[str, Any] = dict(
        vocab_size=160,  # not a multiple of 128: Megatron pads the vocabulary
        hidden_size=48,
        intermediate_size=40,
        head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=3,  # sliding, full, sliding (transformers' default alternation); PP=2 as 2 + 1
        num_local_experts=6,
        num_experts_per_tok=2,
        sliding_window=SLIDING_WINDOW,
        max_position_embeddings=256,
        swiglu_limit=0.6,  # at this initialisation ~30% of gate and ~55% of up values are clamped
        swiglu_alpha=1.3,
        initializer_range=0.15,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "beta_fast": 8.0,  # the ramp spans dims 0.2 .. 2.0 of 8: both ends fractional
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    return GptOssConfig(**fields)


def build_tiny_gpt_oss(out: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny GPT-OSS (fp32 safetensors) under `out`, its biases and sinks drawn non-zero (transformers
    initialises the expert and attention biases to zero, which would hide a misplaced bias)."""
    from transformers import GptOssForCausalLM

    torch.manual_seed(seed)
    model = GptOssForCausalLM(tiny_gpt_oss_config(**overrides))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.normal_(0.0, 0.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(out)
    return out
