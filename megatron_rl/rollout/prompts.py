"""Prompt datasets (JSONL, Parquet) and the endless, seeded, resumable prompt iterator the trainer draws from."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.jsonl import read_jsonl, require_keys

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    """A prompt: text (after any chat template), token ids, reference answer and the row's other fields."""

    text: str
    token_ids: list[int]
    answer: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


def load_prompts(
    path: str | Path,
    tokenizer,
    *,
    prompt_key: str = "prompt",
    answer_key: str | None = "answer",
    apply_chat_template: bool = False,
    max_prompt_tokens: int | None = None,
) -> list[Prompt]:
    """Read prompts from a `.jsonl` or `.parquet` file.

    `prompt_key` holds a string or a list of chat messages (`[{"role", "content"}]`; needs
    `apply_chat_template`). With `apply_chat_template` a string becomes one user message and the tokenizer's
    template is applied with `add_generation_prompt=True`. `answer_key` (None: no answer) is read as a string.
    The row's other fields go to `Prompt.metadata`. Prompts longer than `max_prompt_tokens` are dropped (logged).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} not found")
    rows = _read_parquet(path) if path.suffix == ".parquet" else read_jsonl(path)
    prompts, too_long = [], 0
    for line, row in rows:
        prompt = _to_prompt(row, line, path, tokenizer, prompt_key, answer_key, apply_chat_template)
        if max_prompt_tokens is not None and len(prompt.token_ids) > max_prompt_tokens:
            too_long += 1
            continue
        prompts.append(prompt)
    if too_long:
        logger.warning("%s: dropped %d prompts longer than %d tokens", path, too_long, max_prompt_tokens)
    if not prompts:
        raise ValueError(f"{path} holds no usable prompts")
    return prompts


def _read_parquet(path: Path) -> Iterator[tuple[int, Mapping[str, Any]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError(
            f"reading {path} needs pyarrow, which is not installed: pip install 'megatron-rl[data]' (or pyarrow)"
        ) from err
    yield from enumerate(pq.read_table(path).to_pylist(), start=1)


def _to_prompt(
    row: Mapping[str, Any],
    line: int,
    path: Path,
    tokenizer,
    prompt_key: str,
    answer_key: str | None,
    apply_chat_template: bool,
) -> Prompt:
    where = f"{path}:{line}" if path.suffix != ".parquet" else f"{path} row {line}"
    require_keys(row, tuple(k for k in (prompt_key, answer_key) if k is not None), where)
    value = row[prompt_key]
    if apply_chat_template:
        messages = [{"role": "user", "content": value}] if isinstance(value, str) else list(value)
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    elif isinstance(value, str):
        text = value
    else:
        raise ValueError(f"{where}: {prompt_key!r} is a {type(value).__name__}; chat messages need apply_chat_template")
    # A chat template writes its own special tokens; plain text gets the tokenizer's (e.g. BOS, if it has one).
    token_ids = list(tokenizer(text, add_special_tokens=not apply_chat_template)["input_ids"])
    answer = None if answer_key is None or row[answer_key] is None else str(row[answer_key])
    metadata = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
    return Prompt(text=text, token_ids=token_ids, answer=answer, metadata=metadata)


class PromptIterator:
    """Endless iterator over `prompts`: each epoch is a fresh seeded permutation; resumable from `state_dict()`.

    The order is a function of (seed, epoch) only, so restoring `{"epoch", "index"}` continues exactly where a
    checkpoint left off.
    """

    def __init__(self, prompts: list[Prompt], *, seed: int = 0, shuffle: bool = True):
        if not prompts:
            raise ValueError("PromptIterator needs at least one prompt")
        self.prompts = prompts
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def __iter__(self) -> PromptIterator:
        return self

    def __next__(self) -> Prompt:
        if self.index == len(self._order):
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        prompt = self.prompts[self._order[self.index]]
        self.index += 1
        return prompt

    def state_dict(self) -> dict[str, int | bool]:
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_prompts": len(self.prompts),
        }

    def load_state_dict(self, state: Mapping[str, int | bool]) -> None:
        """Continue from `state`; the dataset size, seed and shuffle must match (else ValueError)."""
        mine = self.state_dict()
        for key in ("num_prompts", "seed", "shuffle"):
            if state[key] != mine[key]:
                raise ValueError(f"prompt iterator state has {key}={state[key]!r} but this iterator has {mine[key]!r}")
        if not 0 <= state["index"] <= len(self.prompts) or state["epoch"] < 0:
            raise ValueError(f"invalid prompt iterator position epoch={state['epoch']} index={state['index']}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)
