"""Megatron-Core layer code the model specs use: MLA and GPT-OSS attention pieces, grouped experts, packed and SDPA
attention, packed RoPE."""

import importlib
from collections.abc import Callable
from typing import Any

BLOCK_SPECS: dict[str, tuple[str, str]] = {
    "mla": ("mla", "mla_block_spec"),
    "gpt_oss": ("gpt_oss", "gpt_oss_block_spec"),
}
"""The decoder block specs a family may name (`ModelFamily.layer_spec`): name -> (module of this package,
function `(config, use_te, vp_stage) -> spec`), imported when a model is built."""


def block_spec(name: str) -> Callable[[Any, bool, int | None], Any]:
    """The block spec builder `name` stands for (`BLOCK_SPECS`)."""
    if name not in BLOCK_SPECS:
        raise KeyError(f"no decoder block spec {name!r}; known: {', '.join(sorted(BLOCK_SPECS))}")
    module, function = BLOCK_SPECS[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), function)
