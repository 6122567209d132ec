"""Supervised (SFT) examples from the user's rows: token ids and the mask of the tokens that train.

A row is either a prompt (text or chat messages) with a response column, or chat messages ending in an assistant
turn (TRL's conversational format: a `messages` column). With a chat template the masks come from rendering it on
growing prefixes of the conversation: what assistant message i adds is the text between
`render(messages[:i], add_generation_prompt=True)` and `render(messages[:i + 1])`, and it trains up to and including
the EOS token it ends with; everything else (system and user turns, the template's headers, the newline after EOS)
does not. Every assistant turn trains. This needs the template's prefix property (a shorter conversation renders as
a prefix of a longer one), which is checked per row: a template that rewrites earlier turns (e.g. one that drops
the reasoning of past assistant turns) is refused, naming the row. Without a chat template the prompt text and the
response are joined as they are and the response is followed by EOS.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from megatron_rl.data.readers import read_rows
from megatron_rl.data.rows import MISSING, lookup
from megatron_rl.rollout.tasks.synthetic_task import SFTPair

MESSAGES_KEY = "messages"  # TRL's conversational SFT column, used when the prompt column is absent


class SFTDataError(ValueError):
    """A row that cannot become an SFT example; the message names the row and the fix."""


def sft_example(
    row: Mapping[str, Any],
    where: str,
    tokenizer: Any,
    *,
    prompt_key: str,
    response_key: str,
    apply_chat_template: bool,
) -> SFTPair:
    """The SFT example of `row` (`where` names it in errors: `file:line`). `SFTPair.prompt_ids` are the tokens before
    the first trained one, `response_ids` the rest up to the last trained token, `loss_mask` 1 where a token trains."""
    response = lookup(row, response_key)
    prompt = lookup(row, prompt_key)
    if prompt is MISSING and prompt_key != MESSAGES_KEY and isinstance(row.get(MESSAGES_KEY), list):
        prompt, prompt_key = row[MESSAGES_KEY], MESSAGES_KEY
    if prompt is MISSING:
        raise SFTDataError(
            f"{where}: no {prompt_key!r} column (the SFT prompt or chat messages: warmup.prompt_key, default "
            f"data.prompt_key) and no {MESSAGES_KEY!r} column; the row has {sorted(row)}"
        )
    if not apply_chat_template:
        return _plain_example(prompt, response, where, tokenizer, prompt_key, response_key)
    messages = _messages(prompt, where, prompt_key)
    if response is not MISSING and response is not None:
        messages += _messages(response, where, response_key, role="assistant")
    if not messages or messages[-1]["role"] != "assistant":
        last = repr(messages[-1]["role"]) if messages else "no"
        raise SFTDataError(
            f"{where}: the conversation ends in {last} turn, not an assistant turn, and the row has no "
            f"{response_key!r} column (warmup.response_key): SFT trains on assistant turns; add the response or "
            "name its column"
        )
    return chat_example(messages, where, tokenizer)


def chat_example(messages: list[dict[str, Any]], where: str, tokenizer: Any) -> SFTPair:
    """The example of a conversation ending in an assistant turn: every assistant turn trains (see the module)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise SFTDataError(
            f"{where}: the tokenizer has no chat template for these chat messages; set data.apply_chat_template=false "
            "with a text prompt and a response column, or use a tokenizer with a chat template"
        )

    def render(turns: list[dict[str, Any]], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)

    full = render(messages, False)
    eos = tokenizer.eos_token or ""
    segments: list[tuple[str, bool]] = []  # (text, trained) in order; their concatenation is `full`
    done = 0  # characters of `full` covered by `segments`
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, end = (len(_prefix_of(full, render(messages[: i + k], k == 0), where, i + k)) for k in (0, 1))
        if start < done or end < start:
            raise SFTDataError(f"{where}: the chat template renders assistant turn {i} before the turns it follows")
        added = full[start:end]
        stop = added.rfind(eos) + len(eos) if eos and eos in added else len(added)  # EOS trains, what follows not
        segments += [(full[done:start], False), (added[:stop], True), (added[stop:], False)]
        done = end
    ids: list[int] = []
    mask: list[int] = []
    for text, trained in segments:
        if text:
            piece = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            ids += piece
            mask += [int(trained)] * len(piece)
    last = max(i for i, m in enumerate(mask) if m) + 1 if any(mask) else 0
    if last == 0:
        raise SFTDataError(f"{where}: the assistant turns render no tokens: nothing to train")
    first = mask.index(1)
    return SFTPair(
        prompt=render(messages[: _first_assistant(messages)], True),
        answer=str(messages[-1].get("content", "")),
        prompt_ids=ids[:first],
        response_ids=ids[first:last],
        loss_mask=mask[first:last],
    )


def _prefix_of(full: str, rendered: str, where: str, turns: int) -> str:
    if not full.startswith(rendered):
        raise SFTDataError(
            f"{where}: the chat template does not render the first {turns} message(s) as a prefix of the whole "
            "conversation (it rewrites earlier turns), so the assistant tokens cannot be found; use a template "
            "that keeps earlier turns as they are, or one assistant turn per row as prompt + response"
        )
    return rendered


def _first_assistant(messages: list[dict[str, Any]]) -> int:
    return next(i for i, m in enumerate(messages) if m["role"] == "assistant")


def _plain_example(
    prompt: Any, response: Any, where: str, tokenizer: Any, prompt_key: str, response_key: str
) -> SFTPair:
    """data.apply_chat_template=false: the prompt text, then the response text and EOS (which train)."""
    if not isinstance(prompt, str):
        raise SFTDataError(
            f"{where}: {prompt_key!r} is a {type(prompt).__name__}; chat messages need data.apply_chat_template=true"
        )
    if response is MISSING or not isinstance(response, str):
        got = "no such column" if response is MISSING else f"a {type(response).__name__}"
        raise SFTDataError(
            f"{where}: the SFT response {response_key!r} (warmup.response_key) must be text with "
            f"data.apply_chat_template=false ({got})"
        )
    if tokenizer.eos_token_id is None:
        raise SFTDataError(f"{where}: the tokenizer has no EOS token to end the SFT response with")
    prompt_ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])  # as load_prompts tokenizes it
    response_ids = list(tokenizer(response, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
    return SFTPair(prompt, response, prompt_ids, response_ids, [1] * len(response_ids))


def _messages(value: Any, where: str, key: str, *, role: str | None = None) -> list[dict[str, Any]]:
    """`value` as chat messages: a text becomes one message of `role` (default user); a list is checked."""
    if isinstance(value, str):
        return [{"role": role or "user", "content": value}]
    if not isinstance(value, list) or not all(isinstance(m, Mapping) and "role" in m for m in value):
        raise SFTDataError(
            f"{where}: {key!r} must be text or a list of chat messages {{role, content}}, got {type(value).__name__}"
        )
    return [dict(m) for m in value]


# ---------------------------------------------------------------------------------------------- a dataset
class SFTDataset:
    """The SFT examples of a file, drawn in a seeded order epoch after epoch: example k of the stream is a pure
    function of (seed, k), so a resumed warm-up continues with the same examples."""

    def __init__(self, examples: Sequence[SFTPair], *, seed: int, where: Sequence[str] | None = None):
        if not examples:
            raise SFTDataError("no SFT examples")
        self.examples = list(examples)
        self.where = list(where) if where is not None else [f"example {i}" for i in range(len(examples))]
        self.seed = seed
        self._orders: dict[int, list[int]] = {}

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        tokenizer: Any,
        *,
        prompt_key: str,
        response_key: str,
        apply_chat_template: bool,
        seed: int,
    ) -> SFTDataset:
        """Every row of a data file or folder (`data.readers.read_rows`) as an SFT example (see `sft_example`)."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"SFT data {path} not found (warmup.data, default data.train)")
        examples, where = [], []
        for name, row in read_rows(path):
            options = {"prompt_key": prompt_key, "response_key": response_key}
            examples.append(sft_example(row, name, tokenizer, apply_chat_template=apply_chat_template, **options))
            where.append(name)
        if not examples:
            raise SFTDataError(f"{path} holds no rows for SFT")
        return cls(examples, seed=seed, where=where)

    def check_lengths(self, max_tokens: int) -> None:
        """SFTDataError naming the longest example if it has more than `max_tokens` tokens (the model's positions)."""
        lengths = [len(p.prompt_ids) + len(p.response_ids) for p in self.examples]
        longest = max(range(len(lengths)), key=lengths.__getitem__)
        if lengths[longest] > max_tokens:
            too_long = sum(n > max_tokens for n in lengths)
            raise SFTDataError(
                f"{self.where[longest]}: the SFT example has {lengths[longest]} tokens, more than the model's "
                f"{max_tokens} positions ({too_long} of {len(lengths)} examples are too long); shorten or drop them"
            )

    def __len__(self) -> int:
        return len(self.examples)

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.examples)))
            random.Random(f"sft:{self.seed}:{epoch}").shuffle(order)
            self._orders = {epoch: order}  # the stream moves forward: one epoch's order is all it needs
        return self._orders[epoch]

    def sft_pairs(self, n: int, *, start: int = 0) -> list[SFTPair]:
        """Examples `start` .. `start + n - 1` of the stream."""
        return [self.examples[self._order(k // len(self))[k % len(self)]] for k in range(start, start + n)]
