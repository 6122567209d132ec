"""The synthetic verifiable task the embedded demo trains on: reverse a string of 3-5 digits.

Format (plain text, no chat template: the tiny model is not a chat model and every character is a token):
prompt ``"4821>"``, response ``"1284"`` followed by the tokenizer's EOS (``<|im_end|>`` for the char tokenizer).
Reward 1.0 for the exact reversed digits ended by a stop token, else 0.0.

Why this task: a random 128-token model has ~0 accuracy (it must emit 3-5 specific tokens then EOS), while the
tiny 2-layer hidden-64 MoE learns it by attention (position-wise copying). Measured greedy accuracy on 100 fresh
strings after supervised steps of batch 64 (AdamW, lr 3e-3, seconds on 2 CPU cores): 30 steps 6%, 60 steps 34%,
100 steps 56%, 300 steps 100% (at lr 1e-3: 100 steps 30%, 300 steps 87%; at lr 1e-4 only 12% after 300 steps),
so a short warm-up leaves room for RL to improve.
There are 111,000 distinct strings; a fixed 10% (by CRC32 of the string, independent of the seed) is held out
for evaluation and never drawn for training or SFT.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

from megatron_rl.rollout.prompts import Prompt
from megatron_rl.rollout.sample import Sample

MIN_DIGITS, MAX_DIGITS = 3, 5
EVAL_PERCENT = 10


def is_eval_string(digits: str) -> bool:
    """The fixed held-out split: about `EVAL_PERCENT`% of all digit strings."""
    return zlib.crc32(digits.encode()) % 100 < EVAL_PERCENT


def prompt_text(digits: str) -> str:
    return f"{digits}>"


def answer_text(digits: str) -> str:
    return digits[::-1]


def synthetic_reward(sample: Sample, text: str, metadata: Mapping[str, Any]) -> float:
    """1.0 if the response is exactly the reversed digits and ended with a stop token (not truncated), else 0.0."""
    return float(sample.finish_reason == "stop" and text.strip() == metadata["answer"])


def synthetic_answer(text: str) -> str | None:
    """The reward's answer for maj@k: the stripped response; None when it is empty."""
    return text.strip() or None


synthetic_reward.extract_answer = synthetic_answer  # type: ignore[attr-defined]


@dataclass(frozen=True)
class SFTPair:
    """A supervised warm-up example; `response_ids` are the answer's tokens followed by EOS (or, for a multi-turn
    example, every turn and observation)."""

    prompt: str
    answer: str
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int] | None = None  # per response token, 1 = trained (None: all); 0 on observations


class SyntheticTask:
    """Digit reversal from a seed: prompt k of a split is a pure function of (seed, split, k)."""

    def __init__(self, seed: int = 0, tokenizer=None):
        """`tokenizer`: encodes prompts (default: the tiny models' char tokenizer); must have an EOS token."""
        if tokenizer is None:
            from megatron_rl.tiny_model import build_char_tokenizer

            tokenizer = build_char_tokenizer()
        if tokenizer.eos_token_id is None:
            raise ValueError("the synthetic task needs a tokenizer with an EOS token to end answers")
        self.seed = seed
        self.tokenizer = tokenizer
        self._train_drawn = 0

    def digits(self, split: str, k: int) -> str:
        """The k-th digit string of `split`: "train" (RL), "sft" (warm-up, also training strings) or "eval"."""
        if split not in ("train", "sft", "eval"):
            raise ValueError(f"split must be 'train', 'sft' or 'eval', got {split!r}")
        rng = random.Random(f"{self.seed}:{split}:{k}")
        while True:
            length = rng.randint(MIN_DIGITS, MAX_DIGITS)
            digits = "".join(rng.choice("0123456789") for _ in range(length))
            if is_eval_string(digits) == (split == "eval"):
                return digits

    def prompt(self, split: str, k: int) -> Prompt:
        digits = self.digits(split, k)
        text = prompt_text(digits)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return Prompt(text=text, token_ids=list(ids), answer=answer_text(digits), metadata={"task": "reverse_digits"})

    def prompts(self, n: int) -> list[Prompt]:
        """The next `n` training prompts (successive calls continue the stream)."""
        out = [self.prompt("train", self._train_drawn + k) for k in range(n)]
        self._train_drawn += n
        return out

    def eval_prompts(self, n: int) -> list[Prompt]:
        """The first `n` held-out prompts (the same for every call)."""
        return [self.prompt("eval", k) for k in range(n)]

    def sft_pairs(self, n: int, *, start: int = 0) -> list[SFTPair]:
        """`n` supervised examples of training strings (a stream of their own, indexed from `start`)."""
        pairs = []
        for k in range(start, start + n):
            prompt = self.prompt("sft", k)
            answer = cast(str, prompt.answer)  # `prompt` always sets it
            answer_ids = self.tokenizer(answer, add_special_tokens=False)["input_ids"]
            pairs.append(
                SFTPair(prompt.text, answer, prompt.token_ids, list(answer_ids) + [self.tokenizer.eos_token_id])
            )
        return pairs

    def stream(self) -> Iterator[Prompt]:
        """An endless iterator of training prompts (for `collect_batch`)."""
        while True:
            yield from self.prompts(1)

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "train_drawn": self._train_drawn}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"synthetic task state has seed {state['seed']} but this task has seed {self.seed}")
        self._train_drawn = int(state["train_drawn"])
