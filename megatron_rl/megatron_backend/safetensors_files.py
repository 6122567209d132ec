"""The safetensors files of a Hugging Face model directory, checked before any tensor is read.

A safetensors file is an 8-byte little-endian header length, a JSON header giving each tensor's byte range
(`data_offsets`, relative to the end of the header), then the data. The header alone tells how long the file
must be, so a truncated download is named here instead of failing deep inside a conversion or a model load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CorruptWeightsError(ValueError):
    """A weights file is missing, truncated or corrupt; the message names the file."""


def safetensors_header(path: Path) -> dict[str, Any]:
    """The tensors of `path` (name -> dtype, shape, data_offsets); CorruptWeightsError if the file cannot hold them."""
    size = path.stat().st_size
    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little") if size >= 8 else 0
        if size < 8 or 8 + header_len > size:
            raise _truncated(path, 8 + header_len if size >= 8 else 8, size)
        try:
            header = json.loads(f.read(header_len))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
            raise CorruptWeightsError(
                f"{path} is truncated or corrupt (its safetensors header cannot be read: {err}): re-download it"
            ) from None
    if 8 + header_len + end > size:
        raise _truncated(path, 8 + header_len + end, size)
    return {k: v for k, v in header.items() if k != "__metadata__"}


def _truncated(path: Path, expected: int, size: int) -> CorruptWeightsError:
    return CorruptWeightsError(
        f"{path} is truncated or corrupt (safetensors header says {expected} bytes, file has {size}): re-download it"
    )


def safetensors_weight_map(model_dir: Path) -> dict[str, str]:
    """Tensor name -> file name, from `model.safetensors.index.json` or the single `model.safetensors`.

    Every file is checked (headers only): a missing shard or a truncated/corrupt file raises CorruptWeightsError
    naming it; no weights file at all raises FileNotFoundError.
    """
    index = model_dir / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise CorruptWeightsError(f"{index} is corrupt (no readable weight_map: {err!r}): re-download it") from None
        for file in sorted(set(weight_map.values())):
            if not (model_dir / file).is_file():
                count = sum(f == file for f in weight_map.values())
                raise CorruptWeightsError(
                    f"{model_dir}: shard {file} is missing ({INDEX} places {count} tensors in it): re-download it"
                )
            safetensors_header(model_dir / file)
        return dict(weight_map)
    single = model_dir / SINGLE
    if not single.is_file():
        raise FileNotFoundError(f"no {SINGLE} or {INDEX} in {model_dir}")
    return {name: SINGLE for name in safetensors_header(single)}
