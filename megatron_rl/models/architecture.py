"""The model's architecture facts, asked of its registered family: `model_dims`, `max_positions`, `is_moe`,
`check_same_architecture`, `same_architecture`.

Every consumer (launch planner, rollout engines, config validation, checkpoint loading) asks here instead of
reading HF config keys itself. Importing this module registers the families; it does not import Megatron.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from megatron_rl.models import get_family
from megatron_rl.models.family import (
    HFConfig,
    ModelDims,
    RouteRecorder,
    UnsupportedModelError,
    WeightMismatchError,
    record_gate_routes,
)

# RoPE has no learned positions: a checkpoint's weights fit any context length.
_NOT_ARCHITECTURE = frozenset({"max_position_embeddings"})


def model_dims(hf_config: HFConfig) -> ModelDims:
    """The architecture of an HF config, by its family; `UnsupportedModelError` for a model no family builds."""
    return get_family(hf_config).dims(hf_config)


def max_positions(hf_config: HFConfig) -> int:
    """The longest sequence (prompt and generated tokens) the model is made for: `max_position_embeddings`, or under
    YaRN `original_max_position_embeddings * factor`, as Hugging Face computes the extended context."""
    dims = model_dims(hf_config)
    rope = hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
    if (rope.get("rope_type") or rope.get("type")) == "yarn" and rope.get("factor"):
        original = rope.get("original_max_position_embeddings") or dims.max_position_embeddings
        return int(int(original) * float(rope["factor"]))
    return dims.max_position_embeddings


def is_moe(hf_config: HFConfig) -> bool:
    """Whether an HF config describes a Mixture-of-Experts model.

    A config that no family describes in full (an unsupported model, or only the keys known so far) counts as
    MoE when any expert-count key is above 1, so the config checks can speak before the model is built.
    """
    try:
        return model_dims(hf_config).num_experts > 1
    except UnsupportedModelError:
        keys = ("num_experts", "num_local_experts", "n_routed_experts")
        return any(int(hf_config.get(k) or 0) > 1 for k in keys)


def route_recorder(hf_config: HFConfig) -> RouteRecorder:
    """How to record the experts an HF model of this config picks (the local engine's routes); a model no family
    describes gets the Qwen-style `*.gate` recorder."""
    try:
        return get_family(hf_config).record_routes
    except UnsupportedModelError:
        return record_gate_routes


def check_same_architecture(expected: HFConfig, got: HFConfig, where: str | Path) -> None:
    """`WeightMismatchError` unless `got` (the config stored with weights at `where`) describes the model built
    from `expected`: same family and every architecture fact of `ModelDims` equal."""

    def mismatch(key: str, got_value: object, expected_value: object) -> WeightMismatchError:
        return WeightMismatchError(
            f"{where}: holds a model with {key}={got_value!r} but the model was built with "
            f"{key}={expected_value!r}: it is a checkpoint of another architecture"
        )

    if expected.get("model_type") != got.get("model_type"):
        raise mismatch("model_type", got.get("model_type"), expected.get("model_type"))
    want = model_dims(expected)
    try:
        have = model_dims(got)
    except UnsupportedModelError as err:
        raise WeightMismatchError(f"{where}: {err}") from err
    for f in fields(ModelDims):
        if f.name not in _NOT_ARCHITECTURE and getattr(want, f.name) != getattr(have, f.name):
            keys = f.metadata.get("hf_keys", (f.name,))
            key = next((k for k in keys if k in got), keys[0])
            raise mismatch(key, getattr(have, f.name), getattr(want, f.name))


def same_architecture(expected: HFConfig, got: HFConfig) -> bool:
    """Whether `got` describes the model built from `expected` (`check_same_architecture` as a question)."""
    try:
        check_same_architecture(expected, got, "")
    except WeightMismatchError:
        return False
    return True
