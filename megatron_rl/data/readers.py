"""Rows of the dataset files people bring, by path: JSON lines (`.jsonl`, or `.json` holding JSON lines or a JSON
list), Parquet, Arrow IPC (`.arrow`, stream or file format), a Hugging Face `datasets` folder written by
`Dataset.save_to_disk`, and a folder of data files (verl's `train.parquet`, the Hub's
`data/train-00000-of-00001.parquet`).

`read_rows(path)` yields `(where, row)`: `where` names the file and row for messages (`train.jsonl:3`, a line of a
JSON lines file; `train.parquet row 17`, 1-based, otherwise) and `row` is a dict whose nested values are Python lists
and dicts. Everything but JSON needs pyarrow; a `datasets` folder is read with pyarrow alone (no `datasets` import).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megatron_rl.jsonl import JsonlError, read_jsonl
from megatron_rl.optional_deps import require

SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
STATE_FILE = "state.json"  # what save_to_disk writes next to its shards: `_data_files` lists them in order
DATASET_DICT_FILE = "dataset_dict.json"  # a DatasetDict's save_to_disk: {"splits": [...]}, one subfolder each
BATCH_ROWS = 1024  # rows converted to Python at a time
# JSON files of a Hub repository or a `datasets` folder that describe the data rather than hold it
METADATA_FILES = frozenset({STATE_FILE, DATASET_DICT_FILE, "dataset_info.json", "dataset_infos.json"})


class DataFileError(ValueError):
    """A data file or folder that cannot be read; the message names it and, where there is one, the fix."""


Row = tuple[str, dict[str, Any]]


def read_rows(path: str | Path) -> Iterator[Row]:
    """Every row of the file or folder `path`, in order, as `(where, row)` (see the module docstring)."""
    for file in data_files(path):
        yield from _READERS[file.suffix](file)


def data_files(path: str | Path) -> list[Path]:
    """The files `path` stands for, in reading order: itself, a `datasets` folder's shards, or a folder's data files.

    A folder of several splits (a DatasetDict, or `train` and `test` files side by side) is refused, naming them."""
    path = Path(path)
    if path.is_file():
        if path.suffix not in _READERS:
            raise DataFileError(
                f"{path}: unknown data format {path.suffix!r}; give a {', '.join(SUFFIXES)} file or a `datasets` folder"
            )
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"data file or folder {path} not found")
    if (path / DATASET_DICT_FILE).is_file():
        splits = _dataset_dict_splits(path)
        raise DataFileError(
            f"{path} is a DatasetDict with the splits {', '.join(map(repr, splits))}: name one split's folder, e.g. "
            f"data.train={path / (splits[0] if splits else 'train')}"
        )
    if (path / STATE_FILE).is_file():
        return _saved_dataset_files(path)
    return _folder_files(path)


# ---------------------------------------------------------------------------------------------- one file
def read_json(path: Path) -> Iterator[Row]:
    """`.jsonl`, or a `.json` file holding JSON lines or a JSON list of objects."""
    if path.suffix == ".json" and _starts_with(path, b"["):
        try:
            items = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise DataFileError(f"{path}: not a valid JSON list ({err})") from None
        for number, item in enumerate(items, start=1):
            if not isinstance(item, dict):
                raise DataFileError(f"{path} row {number}: expected a JSON object, got {type(item).__name__}")
            yield f"{path} row {number}", item
        return
    try:
        for number, row in read_jsonl(path):
            yield f"{path}:{number}", row
    except JsonlError as err:
        if path.suffix == ".json":  # a pretty-printed object fails on its first line: say what .json can hold
            raise JsonlError(f"{err} (a .json file is read as JSON lines or a JSON list of objects)") from None
        raise


def read_parquet(path: Path) -> Iterator[Row]:
    """A Parquet file, row by row."""
    pq = require("pyarrow.parquet")
    pa = require("pyarrow")
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS)
        yield from _numbered(path, batches)
    except (pa.ArrowException, OSError) as err:
        raise DataFileError(f"{path}: not a readable Parquet file ({err})") from None


def read_arrow(path: Path) -> Iterator[Row]:
    """An Arrow IPC file (`ARROW1` magic) or stream (what `datasets` writes: cache files, save_to_disk shards)."""
    pa = require("pyarrow")
    ipc = require("pyarrow.ipc")
    try:
        with pa.memory_map(str(path)) as source:
            if _starts_with(path, b"ARROW1"):
                reader = ipc.open_file(source)
                batches: Any = (reader.get_batch(i) for i in range(reader.num_record_batches))
            else:
                batches = ipc.open_stream(source)
            yield from _numbered(path, batches)
    except (pa.ArrowException, OSError) as err:
        raise DataFileError(f"{path}: not an Arrow IPC stream or file ({err})") from None


def _numbered(path: Path, batches: Any) -> Iterator[Row]:
    number = 0
    for batch in batches:
        for row in batch.to_pylist():
            number += 1
            yield f"{path} row {number}", row


def _starts_with(path: Path, magic: bytes) -> bool:
    with path.open("rb") as f:
        head = f.read(64).lstrip() if magic == b"[" else f.read(len(magic))
    return head.startswith(magic)


_READERS = {".jsonl": read_json, ".json": read_json, ".parquet": read_parquet, ".arrow": read_arrow}


# ---------------------------------------------------------------------------------------------- folders
def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataFileError(f"{path}: not valid JSON ({err})") from None


def _dataset_dict_splits(folder: Path) -> list[str]:
    splits = _load_json(folder / DATASET_DICT_FILE)
    if isinstance(splits, dict) and isinstance(splits.get("splits"), list):
        return [str(s) for s in splits["splits"]]
    return sorted(p.name for p in folder.iterdir() if (p / STATE_FILE).is_file())


def _saved_dataset_files(folder: Path) -> list[Path]:
    """The shards `state.json` lists (`{"_data_files": [{"filename": "data-00000-of-00001.arrow"}, ...]}`)."""
    state = _load_json(folder / STATE_FILE)
    entries = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and "filename" in e for e in entries):
        raise DataFileError(
            f"{folder / STATE_FILE}: no `_data_files` list of {{filename}}: not a folder written by save_to_disk"
        )
    if state.get("_indices_data_files"):
        raise DataFileError(
            f"{folder}: saved with an indices mapping (an old `datasets` version); save it again with "
            "`dataset.flatten_indices().save_to_disk(...)`"
        )
    files = []
    for entry in entries:
        name = str(entry["filename"])
        if Path(name).name != name or name in ("", ".", ".."):
            raise DataFileError(f"{folder / STATE_FILE}: shard name {name!r} is not a plain file name")
        file = folder / name
        if not file.is_file():
            raise DataFileError(f"{folder}: the shard {name} that {STATE_FILE} lists is missing")
        if file.suffix != ".arrow":
            raise DataFileError(f"{folder}: the shard {name} is not an .arrow file")
        files.append(file)
    return files


_SHARD = re.compile(r"^(?P<split>.+?)[-_]\d+[-_]of[-_]\d+(?:[-_].*)?$")  # train-00000-of-00003[-<hash>]


def _split_of(file: Path, folder: Path) -> str:
    """The split a data file of `folder` belongs to: `data/train-00000-of-00002.parquet` -> `data/train`,
    `default/train/0000.parquet` -> `default/train`, `test.parquet` -> `test`."""
    relative = file.relative_to(folder)
    stem = relative.name[: -len(relative.suffix)]
    match = _SHARD.match(stem)
    if match:
        stem = match["split"]
    elif stem.isdigit():
        return relative.parent.as_posix()
    return (relative.parent / stem).as_posix()


def _folder_files(folder: Path) -> list[Path]:
    files = sorted(
        p
        for p in folder.rglob("*")
        if p.suffix in _READERS
        and p.name not in METADATA_FILES
        and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)  # .cache/, .git/
    )
    if not files:
        raise DataFileError(
            f"{folder}: no {', '.join(SUFFIXES)} files and no {STATE_FILE} (a `datasets` save_to_disk folder) in it"
        )
    splits: dict[str, list[Path]] = {}
    for file in files:
        splits.setdefault(_split_of(file, folder), []).append(file)
    if len(splits) > 1:
        listed = ", ".join(f"{name} ({len(group)} file{'s' * (len(group) > 1)})" for name, group in splits.items())
        single = next((group[0] for group in splits.values() if len(group) == 1), None)
        example = f", e.g. data.train={single}" if single is not None else ""
        raise DataFileError(
            f"{folder} holds the data of several splits: {listed}; name one split's file{example}, or put one "
            "split's shards in a folder of their own"
        )
    return files
