"""Megatron distributed checkpoints of a run: saving and loading, the background writer, RNG state files."""
