"""Lazy imports of optional, mostly GPU-only, dependencies with a message naming the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

# module name -> (pip extra that provides it, what it is used for)
OPTIONAL_MODULES: dict[str, tuple[str, str]] = {
    "transformer_engine": ("gpu", "Transformer Engine layers and fused kernels on GPU"),
    "triton": ("gpu", "compiled Triton log-prob and GSPO kernels"),
    "apex": ("gpu", "NVIDIA apex fused optimizers (install from NVIDIA's repository, not PyPI's 'apex')"),
    "flash_attn": ("gpu", "flash attention"),
    "sglang": ("sglang", "the SGLang rollout server"),
    "sglang_router": ("sglang", "the SGLang router in front of several servers"),
    "pyarrow": ("data", "Parquet, Arrow and `datasets`-folder prompt files"),
    "math_verify": ("math", "the math, dapo and auto rewards (Hugging Face's math-verify checker)"),
}


class MissingOptionalDependency(ImportError):
    """An optional dependency is needed by the selected configuration but is not installed."""


def require(module: str) -> ModuleType:
    """Import an optional module or raise an error that names the extra to install.

    >>> require("math").pi > 3
    True
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        top = module.split(".")[0]
        extra, purpose = OPTIONAL_MODULES.get(top, (None, "this feature"))
        hint = f"pip install 'megatron-rl[{extra}]'" if extra else f"pip install {top}"
        raise MissingOptionalDependency(
            f"'{module}' is required for {purpose} but could not be imported ({err}); install it with: {hint}"
        ) from err


def is_available(module: str) -> bool:
    """True when `module` imports; never raises."""
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - a broken optional install counts as unavailable
        return False
    return True
