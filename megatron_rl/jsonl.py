"""Reading JSONL input files: every bad line is reported as `<file>:<line>: <problem>`."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any


class JsonlError(ValueError):
    """A line of a JSONL file that is not a JSON object (or lacks a key); the message starts `<file>:<line>:`."""


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, object) for each non-blank line of `path`; JsonlError names the file and line."""
    path = Path(path)
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise JsonlError(f"{path}:{number}: not valid UTF-8 ({err})") from None
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:  # its own line/column count within the one line: give the column
                raise JsonlError(f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(row, dict):
                raise JsonlError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
            yield number, row


def require_keys(row: Mapping[str, Any], keys: tuple[str, ...], where: str) -> None:
    """JsonlError `"<where>: missing key 'k' (has [...])"` for the first of `keys` absent from `row`."""
    for key in keys:
        if key not in row:
            raise JsonlError(f"{where}: missing key {key!r} (has {sorted(row)})")


def records_before_step(path: Path, first_step: int) -> list[dict[str, Any]]:
    """The JSON records of a run log (`metrics.jsonl`, `samples.jsonl`, ...) whose integer `step` is below
    `first_step`, in file order; a line cut off by a crash is skipped. Empty for a missing file."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # the last line of a start killed while writing it
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] < first_step:
            records.append(record)
    return records


def replace_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    """Write `records` to `path` as JSON lines, atomically (a temporary file renamed over it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, path)
