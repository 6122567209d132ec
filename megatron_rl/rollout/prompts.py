"""Prompts from the user's data files (see megatron_rl.data: JSONL, Parquet, Arrow, `datasets` folders; dotted keys;
text or chat messages) and the endless, seeded, resumable prompt iterator the trainer draws from."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from megatron_rl.data.readers import read_parquet, read_rows
from megatron_rl.data.rows import answer_text, prompt_field, require_field

logger = logging.getLogger(__name__)

TOKENIZE_BATCH = 1024  # prompts tokenized in one call
ANSWER_HINT = "set data.answer_key to the column of the reference answer, or to null if the rows have none"


@dataclass(frozen=True)
class Prompt:
    """A prompt: text (after any chat template), token ids, reference answer and the row's other fields."""

    text: str
    token_ids: list[int]
    answer: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    origin: str = field(default="", compare=False)  # the file and row it came from: "train.parquet row 17"


def load_prompts(
    path: str | Path,
    tokenizer: Any,
    *,
    prompt_key: str = "prompt",
    answer_key: str | None = "answer",
    apply_chat_template: bool = False,
    max_prompt_tokens: int | None = None,
) -> list[Prompt]:
    """Read prompts from a data file or folder (`megatron_rl.data.readers.read_rows`).

    `prompt_key` (dotted for nested columns) holds text or chat messages (`[{"role", "content"}]`, which need
    `apply_chat_template`); a row without it but with a `messages` column is prompted with those messages
    (`megatron_rl.data.rows.prompt_field`). With `apply_chat_template` a text becomes one user message and the
    tokenizer's template is applied with `add_generation_prompt=True`. `answer_key` (None: no answer) becomes
    `Prompt.answer` as text (`rows.answer_text`). Every other column goes to `Prompt.metadata` as it is (a dotted
    answer key leaves its column there too). Prompts longer than `max_prompt_tokens` are dropped (logged).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"prompt file {path} not found")
    if apply_chat_template:
        check_chat_template(tokenizer)
    prompts: list[Prompt] = []
    pending: list[Prompt] = []  # read, not yet tokenized: a batch of texts tokenizes ~2x faster than one by one

    def tokenize_pending() -> None:
        # A chat template writes its own special tokens; plain text gets the tokenizer's (e.g. BOS, if it has one).
        batch = tokenizer([p.text for p in pending], add_special_tokens=not apply_chat_template)["input_ids"]
        prompts.extend(replace(p, token_ids=list(ids)) for p, ids in zip(pending, batch, strict=True))
        pending.clear()

    for where, row in read_rows(path):
        pending.append(_to_prompt(row, where, tokenizer, prompt_key, answer_key, apply_chat_template))
        if len(pending) == TOKENIZE_BATCH:
            tokenize_pending()
    if pending:
        tokenize_pending()
    too_long = 0
    if max_prompt_tokens is not None:
        kept = [p for p in prompts if len(p.token_ids) <= max_prompt_tokens]
        too_long, prompts = len(prompts) - len(kept), kept
    if too_long:
        logger.warning("%s: dropped %d prompts longer than %d tokens", path, too_long, max_prompt_tokens)
    if not prompts:
        raise ValueError(f"{path} holds no usable prompts")
    return prompts


def check_chat_template(tokenizer: Any) -> None:
    """ValueError naming `data.apply_chat_template=false` when `tokenizer` has no chat template to apply."""
    if not getattr(tokenizer, "chat_template", None) or not hasattr(tokenizer, "apply_chat_template"):
        raise ValueError(
            "the tokenizer has no chat template, so data.apply_chat_template=true cannot format the prompts: set "
            "data.apply_chat_template=false to give the model each prompt's text as it is (rows of chat messages "
            "are then refused), or use a tokenizer with a chat template (model.tokenizer_path)"
        )


def _read_parquet(path: str | Path) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """(row number, row) of a Parquet file."""
    for number, (_, row) in enumerate(read_parquet(Path(path)), start=1):
        yield number, row


def _to_prompt(
    row: Mapping[str, Any],
    where: str,
    tokenizer: Any,
    prompt_key: str,
    answer_key: str | None,
    apply_chat_template: bool,
) -> Prompt:
    column, value = prompt_field(row, prompt_key, where)
    answer = None if answer_key is None else answer_text(require_field(row, answer_key, where, ANSWER_HINT))
    if apply_chat_template:
        messages = [{"role": "user", "content": value}] if isinstance(value, str) else value
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    elif isinstance(value, str):
        text = value
    else:
        raise ValueError(
            f"{where}: {column!r} holds chat messages, which need the tokenizer's chat template: set "
            "data.apply_chat_template=true (with a tokenizer that has one), or give the prompt as text"
        )
    metadata = {k: v for k, v in row.items() if k not in (column, answer_key)}
    if not isinstance(value, str):  # TRL-style rewards get a chat row's prompt as its messages (user_functions)
        metadata["prompt_messages"] = list(value)
    return Prompt(text=text, token_ids=[], answer=answer, metadata=metadata, origin=where)  # ids: load_prompts


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

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from `state`; the dataset size, seed and shuffle must match (else ValueError)."""
        if "sources" in state:
            raise ValueError(
                f"the checkpoint's prompt position is of a mixture of {len(state['sources'])} datasets, but data.train "
                "is now one: resume with the checkpoint's data.train"
            )
        mine = self.state_dict()
        for key in ("num_prompts", "seed", "shuffle"):
            if state[key] != mine[key]:
                raise ValueError(f"prompt iterator state has {key}={state[key]!r} but this iterator has {mine[key]!r}")
        if not 0 <= state["index"] <= len(self.prompts) or state["epoch"] < 0:
            raise ValueError(f"invalid prompt iterator position epoch={state['epoch']} index={state['index']}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)
