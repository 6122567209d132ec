"""LoRA: low-rank adapters on the Megatron model's linear layers (`adapters.py`)."""
