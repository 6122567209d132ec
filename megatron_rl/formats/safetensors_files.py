"""The safetensors files of a Hugging Face model directory: checked before any tensor is read, and written.

A safetensors file is an 8-byte little-endian header length, a JSON header giving each tensor's byte range
(`data_offsets`, relative to the end of the header), then the data. The header alone tells how long the file
must be, so a truncated download is named here instead of failing deep inside a conversion or a model load.

`write_safetensors_dir` is the one writer of HF weights (export after warm-up, conversion, disk weight sync):
shards `model-00001.safetensors`, ... plus `model.safetensors.index.json`, built in a staging directory that is
renamed to the final name when complete.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_rl.formats.checkpoint_format import fresh_staging_dir, publish_dir

if TYPE_CHECKING:
    import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Files of an HF model directory besides config.json and the weights.
HF_EXTRA_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


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


def is_weights_file(name: str) -> bool:
    return name.endswith(".safetensors") or name == INDEX


def shard_name(index: int) -> str:
    """The file name of the `index`-th shard (from 1)."""
    return f"model-{index:05d}.safetensors"


@dataclass(frozen=True)
class WrittenWeights:
    tensors: int
    bytes: int
    shards: int  # files written


def write_safetensors_dir(
    out: Path,
    buckets: Iterable[Sequence[tuple[str, torch.Tensor]]],
    *,
    extra_files: Callable[[Path], None] | None = None,
    overwrite: bool = True,
) -> WrittenWeights:
    """Write `buckets` of HF-named tensors as the weights of the HF model directory `out`.

    Bucket i becomes shard `shard_name(i + 1)` (an empty bucket writes no file and keeps its number), each with
    metadata {"format": "pt"}; the index lists every tensor's shard, names sorted. Tensors are copied to the CPU
    one bucket at a time, so host memory holds one bucket. `extra_files(staging)` adds the non-weight files
    (config, tokenizer) before the directory is published. An existing `out` is replaced if `overwrite`, else
    it must be empty.
    """
    from safetensors.torch import save_file

    staging = fresh_staging_dir(out)
    weight_map: dict[str, str] = {}
    tensors = nbytes = shards = 0
    for i, bucket in enumerate(buckets):
        if bucket:
            name = shard_name(i + 1)
            cpu = {n: t.detach().to("cpu").contiguous() for n, t in bucket}
            save_file(cpu, str(staging / name), metadata={"format": "pt"})
            shards += 1
            for tensor_name, tensor in bucket:
                weight_map[tensor_name] = name
                tensors += 1
                nbytes += tensor.numel() * tensor.element_size()
            del cpu
        del bucket  # before the next bucket is built: host memory holds one bucket, not two
    index = {"metadata": {"total_size": nbytes}, "weight_map": dict(sorted(weight_map.items()))}
    (staging / INDEX).write_text(json.dumps(index, indent=1))
    if extra_files is not None:
        extra_files(staging)
    publish_dir(staging, out, overwrite=overwrite)
    return WrittenWeights(tensors, nbytes, shards)


def copy_files(source: Path, dest: Path, names: Iterable[str]) -> None:
    """Copy each of `names` that `source` holds into `dest` (metadata kept)."""
    for name in names:
        if (source / name).is_file():
            shutil.copy2(source / name, dest / name)
