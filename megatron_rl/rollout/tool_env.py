"""The tool-calling environment ("tools" in `env.ENVIRONMENTS`): each turn's tool calls are run and their results
are the observation; a turn without a call is the final answer and ends the episode.

It gives no reward itself (score the final answer with a reward function) and counts, per trajectory,
`tool_calls` and `tool_errors` (calls that could not be run, and tool answers starting with "error:").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from megatron_rl.rollout.env import Observation, StepResult
from megatron_rl.rollout.prompts import Prompt
from megatron_rl.rollout.tool_calls import ToolCall, get_tool_call_format
from megatron_rl.rollout.tools import get_tool


class ToolEnv:
    def __init__(
        self,
        tools: Sequence[str] = ("calculator",),
        tool_call_format: str = "hermes",
        tool_options: Mapping[str, Mapping[str, Any]] | None = None,
    ):
        """`tools`: registered names or dotted paths; `tool_options`: keyword options per tool, e.g.
        ``{"python": {"timeout_s": 5}}``."""
        options = tool_options or {}
        self.tools = {name: get_tool(name, **options.get(name, {})) for name in tools}
        self.format = get_tool_call_format(tool_call_format)

    def reset(self, prompt: Prompt) -> Observation:
        return prompt.token_ids

    def step(self, text: str, token_ids: list[int]) -> StepResult:
        calls = self.format.parse(text, self.tools.keys())
        if not calls:
            return StepResult("", done=True)
        results = [self.tools[c.name](c.arguments) if isinstance(c, ToolCall) else c.message for c in calls]
        errors = sum(result.startswith("error:") for result in results)
        return StepResult(self.format.format_results(results), info={"tool_calls": len(calls), "tool_errors": errors})
