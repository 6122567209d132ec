"""Model families (one module each); importing this package registers all of them."""

from megatron_rl.megatron_backend.models import mixtral, qwen2_moe, qwen3_moe  # noqa: F401  (register families)
from megatron_rl.megatron_backend.models.family import (
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
