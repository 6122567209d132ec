"""Megatron-free facts about the models the trainer works on, read from their Hugging Face files."""
