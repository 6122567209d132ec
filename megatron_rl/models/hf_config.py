"""The one reader of a Hugging Face model directory's `config.json` (Megatron-free: config validation, the launch
planner and the rollout engines read it as plain data)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_hf_config(model_dir: str | Path, *, role: str = "the model directory") -> dict[str, Any]:
    """`model_dir`/config.json; the error names `role` (the argument or config key that gave the directory)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: {role} must be a Hugging Face model directory (config.json + *.safetensors)"
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}): re-download it") from None


def read_hf_config_if_present(model_dir: str | Path) -> dict[str, Any] | None:
    """`model_dir`/config.json if it exists and parses yet (None for a model still to be built, whose absence
    config validation reports in its own words)."""
    try:
        return read_hf_config(model_dir)
    except (OSError, ValueError):
        return None
