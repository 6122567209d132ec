"""Fields of a data row: dotted keys into nested columns, prompts as text or chat messages, answers as text.

Conventions (docs/datasets.md has the table of layouts):
- A key is a column name or a dotted path into nested columns (`reward_model.ground_truth`, verl); a column whose
  own name holds the dot wins.
- A prompt is text, or chat messages `[{role, content}, ...]` (verl's `prompt`, TRL's conversational `prompt`). A row
  without the prompt column but with a `messages` column (TRL's conversational format) is prompted with its
  messages up to the last non-assistant turn: trailing assistant turns are the reference reply, not the prompt.
  Message keys whose value is null are dropped (Parquet fills absent struct fields with nulls, which chat templates
  would read as set).
- An answer is text: strings as they are, other scalars by `str()` (`72`, `0.5`, `True`), lists and dicts as JSON
  text (`["1", "2"]`), null as None.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from typing import Any

from megatron_rl.jsonl import JsonlError

MESSAGES_KEY = "messages"  # TRL's conversational column, the prompt when the prompt column is absent


class RowError(JsonlError):
    """A row that cannot be used; the message starts with the file and row and names the fix."""


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING: Any = _Missing()


def lookup(row: Mapping[str, Any], key: str) -> Any:
    """`row[key]`, where a dotted key reads nested columns (`reward_model.ground_truth`); MISSING if absent."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return MISSING
        value = value[part]
    return value


def key_paths(row: Mapping[str, Any], depth: int = 3) -> list[str]:
    """Every key of `row` and, `depth` levels down, every dotted path into its nested dicts."""
    paths = []
    for key, value in row.items():
        paths.append(str(key))
        if depth > 1 and isinstance(value, Mapping):
            paths += [f"{key}.{sub}" for sub in key_paths(value, depth - 1)]
    return paths


def missing_key_error(row: Mapping[str, Any], key: str, where: str, hint: str = "") -> RowError:
    """`<where>: missing key 'k' (has [...]); closest: 'x'` (when one is close), then `hint`."""
    closest = difflib.get_close_matches(key, key_paths(row), n=1, cutoff=0.6)
    message = f"{where}: missing key {key!r} (has {sorted(row)})"
    if closest:
        message += f"; closest: {closest[0]!r}"
    return RowError(message + (f"; {hint}" if hint else ""))


def require_field(row: Mapping[str, Any], key: str, where: str, hint: str = "") -> Any:
    """`lookup(row, key)`, or a RowError naming the row's keys and the closest one."""
    value = lookup(row, key)
    if value is MISSING:
        raise missing_key_error(row, key, where, hint)
    return value


def prompt_field(row: Mapping[str, Any], key: str, where: str) -> tuple[str, str | list[dict[str, Any]]]:
    """`(column used, prompt)`: the text or chat messages of `row[key]`, or of its `messages` column (see module)."""
    value = lookup(row, key)
    if value is MISSING and key != MESSAGES_KEY and isinstance(row.get(MESSAGES_KEY), list):
        messages = chat_messages(row[MESSAGES_KEY], where, MESSAGES_KEY)
        while messages and messages[-1]["role"] == "assistant":
            messages.pop()
        if not messages:
            raise RowError(f"{where}: {MESSAGES_KEY!r} holds only assistant turns: no prompt to answer")
        return MESSAGES_KEY, messages
    if value is MISSING:
        raise missing_key_error(row, key, where)
    if isinstance(value, str):
        return key, value
    if isinstance(value, list):
        return key, chat_messages(value, where, key)
    raise RowError(
        f"{where}: {key!r} is {'null' if value is None else 'a ' + type(value).__name__}; a prompt is text or chat "
        "messages [{role, content}]"
    )


def chat_messages(value: list[Any], where: str, key: str) -> list[dict[str, Any]]:
    """`value` checked as chat messages (each a dict with a string `role` and `content`), null-valued keys dropped."""
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) or "content" not in message:
            raise RowError(
                f"{where}: {key!r} item {i} is not a chat message {{role, content}} (got {_short(message)})"
            )
        messages.append({k: v for k, v in message.items() if v is not None})
    if not messages:
        raise RowError(f"{where}: {key!r} is an empty list of chat messages")
    return messages


def answer_text(value: Any) -> str | None:
    """A reference answer as text: see the module docstring."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (list, dict)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
