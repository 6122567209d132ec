"""Model families (one module each); importing this package registers all of them.

Every module of this package is imported here; a family module registers its `ModelFamily` when imported, so a
new family is one new file. Modules must not import Megatron at module level (the rollout side imports this).
"""

import importlib
import pkgutil

from megatron_rl.models.family import (
    ModelDims,
    ModelFamily,
    UnsupportedModelError,
    get_family,
    supported_families,
    supported_model_types,
)

__all__ = [
    "ModelDims",
    "ModelFamily",
    "UnsupportedModelError",
    "get_family",
    "supported_families",
    "supported_model_types",
]

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
