"""Megatron-Core backend: platform bridge, parallel layout, model families, weights, actor."""
