"""On-disk formats the trainer reads and writes, Megatron-free: the checkpoint folder layout and Hugging Face
safetensors folders."""
