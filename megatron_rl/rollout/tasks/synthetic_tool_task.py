"""The synthetic tool-use task: multiply two 2-3 digit numbers with the calculator tool.

Format (plain text, no chat template; the compact tool-call format of `tool_calls.CompactFormat`): prompt
``"37*58="``; the model's first turn calls the calculator, ``"[calculator:37*58]"`` + EOS; the environment
(`tool_env.ToolEnv` with ``tool_call_format="compact"``) answers ``"=2146\\n"``; the model's second turn is the
answer, ``"2146"`` + EOS, and (no call in it) ends the episode. Reward 1.0 for the exact product in the final turn
ended by a stop token, else 0.0.

Why this task: the tiny 2-layer hidden-64 model cannot multiply (products have up to 6 digits), but it can copy:
the operands into the call and the tool's result into the answer, which attention learns (as in the digit
reversal demo, `synthetic_task`). A whole trajectory is at most 8 + 21 + 8 + 7 = 44 tokens. Both copies must be
exact, so a short warm-up leaves room for RL to raise the tool-call success rate and the accuracy.
There are 980,100 distinct problems; a fixed 10% (by CRC32 of the prompt text, independent of the seed) is held
out for evaluation and never drawn for training or SFT.
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Mapping
from typing import Any

from megatron_rl.rollout.agent.tool_calls import CompactFormat, ToolCall
from megatron_rl.rollout.agent.tool_env import ToolEnv
from megatron_rl.rollout.agent.trajectory import TrajectoryBuilder
from megatron_rl.rollout.prompts import Prompt
from megatron_rl.rollout.sample import Sample
from megatron_rl.rollout.tasks.synthetic_task import SFTPair, SyntheticTask

MIN_OPERAND, MAX_OPERAND = 10, 999
EVAL_PERCENT = 10
TOOL = "calculator"
# The environment the task's trajectories assume (`rollout.env: tools` with these `rollout.env_options`).
ENV_OPTIONS: dict[str, Any] = {"tools": [TOOL], "tool_call_format": "compact"}

_SPECIAL_TOKEN = re.compile(r"<\|[a-z_]+\|>")


def is_eval_problem(text: str) -> bool:
    """The fixed held-out split: about `EVAL_PERCENT`% of all problems (by their prompt text)."""
    return zlib.crc32(text.encode()) % 100 < EVAL_PERCENT


def prompt_text(a: int, b: int) -> str:
    return f"{a}*{b}="


def final_answer(sample: Sample | None, text: str) -> str:
    """The final turn's text without special tokens: `metadata["turn_texts"][-1]` (multi-turn rollouts), else (or
    without a sample) the last line of the response (an observation of the compact format ends with a newline)."""
    turn_texts = sample.metadata.get("turn_texts") if sample is not None else None
    last = turn_texts[-1] if turn_texts else text.rsplit("\n", 1)[-1]
    return _SPECIAL_TOKEN.sub("", last).strip()


def tool_task_reward(sample: Sample, text: str, metadata: Mapping[str, Any]) -> float:
    """1.0 if the final turn is exactly the product and the trajectory ended with a stop token, else 0.0."""
    return float(sample.finish_reason == "stop" and final_answer(sample, text) == metadata["answer"])


def tool_task_answer(text: str, *, sample: Sample | None = None) -> str | None:
    """The reward's answer for maj@k: `final_answer(sample, text)` (`sample` gives the turn texts; without it, the
    response's last line); None when it is empty."""
    return final_answer(sample, text) or None


tool_task_reward.extract_answer = tool_task_answer  # type: ignore[attr-defined]


class ToolTask(SyntheticTask):
    """Multiplication with a calculator from a seed: prompt k of a split is a pure function of (seed, split, k).
    The prompt stream, held-out prompts and resumable state are `SyntheticTask`'s."""

    def __init__(self, seed: int = 0, tokenizer=None):
        super().__init__(seed, tokenizer)
        self.format = CompactFormat()
        self.env = ToolEnv(**ENV_OPTIONS)  # stateless between episodes: one serves every SFT trajectory

    def operands(self, split: str, k: int) -> tuple[int, int]:
        """The k-th problem of `split`: "train" (RL), "sft" (warm-up, also training problems) or "eval"."""
        if split not in ("train", "sft", "eval"):
            raise ValueError(f"split must be 'train', 'sft' or 'eval', got {split!r}")
        rng = random.Random(f"{self.seed}:{split}:{k}")
        while True:
            a, b = rng.randint(MIN_OPERAND, MAX_OPERAND), rng.randint(MIN_OPERAND, MAX_OPERAND)
            if is_eval_problem(prompt_text(a, b)) == (split == "eval"):
                return a, b

    def prompt(self, split: str, k: int) -> Prompt:
        a, b = self.operands(split, k)
        text = prompt_text(a, b)
        return Prompt(text=text, token_ids=self._encode(text), answer=str(a * b), metadata={"task": "tool_multiply"})

    def sft_pairs(self, n: int, *, start: int = 0) -> list[SFTPair]:
        """`n` supervised trajectories of training problems (a stream of their own, indexed from `start`): the
        call turn, the calculator's observation (loss mask 0) and the answer turn, each turn ended by EOS."""
        return [self.sft_pair(self.prompt("sft", k)) for k in range(start, start + n)]

    def sft_pair(self, prompt: Prompt) -> SFTPair:
        """The ideal trajectory for `prompt`, built as a rollout builds it: the environment runs the call."""
        builder = TrajectoryBuilder(prompt.token_ids, max_turns=2, max_tokens=len(prompt.token_ids) + 64)
        call = self.format.format_call(ToolCall(TOOL, {"expression": prompt.text.removesuffix("=")}))
        call_ids = self._encode(call) + [self.tokenizer.eos_token_id]
        builder.add_turn(call_ids, [0.0] * len(call_ids), "sft", "stop")
        observation = self.env.step(self.tokenizer.decode(call_ids), call_ids).observation
        builder.add_observation(self._encode(str(observation)))
        answer_ids = self._encode(str(prompt.answer)) + [self.tokenizer.eos_token_id]
        builder.add_turn(answer_ids, [0.0] * len(answer_ids), "sft", "stop")
        trajectory = builder.build(done=True)
        return SFTPair(prompt.text, str(prompt.answer), prompt.token_ids, trajectory.response_ids, trajectory.loss_mask)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
