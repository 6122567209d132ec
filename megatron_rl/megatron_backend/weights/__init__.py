"""Weights in Hugging Face names: loading, streaming export, saving and conversion of checkpoints."""
