"""Megatron-Core layer code the model specs use: MLA and GPT-OSS attention pieces, grouped experts, packed and SDPA
attention, packed RoPE."""
