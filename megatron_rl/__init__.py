"""megatron_rl: RL post-training for large Mixture-of-Experts LLMs on Megatron-Core.

    from megatron_rl import RLConfig, load_config, train
    result = train(load_config("examples/tiny_moe_gspo.yaml", ["trainer.steps=2"]))

The names below are imported on first use (PEP 562), so `import megatron_rl.algorithms` stays free of Megatron.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "train": "megatron_rl.api",
    "evaluate": "megatron_rl.api",
    "load_config": "megatron_rl.config",
    "RLConfig": "megatron_rl.config",
    "ModelConfig": "megatron_rl.config",
    "AlgoConfig": "megatron_rl.config",
    "DataConfig": "megatron_rl.config",
    "RolloutConfig": "megatron_rl.config",
    "TrainerConfig": "megatron_rl.config",
    "WarmupConfig": "megatron_rl.config",
    "LoggingConfig": "megatron_rl.config",
}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'megatron_rl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
