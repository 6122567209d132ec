"""Implementations of the `megatron-rl` subcommands, one module each."""
