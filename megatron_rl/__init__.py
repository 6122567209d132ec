"""megatron_rl: RL post-training for large Mixture-of-Experts LLMs on Megatron-Core."""

__version__ = "0.1.0"
