"""The tool-calling environment ("tools" in `env.ENVIRONMENTS`): each turn's tool calls are run and their results
are the observation; a turn without a call is the final answer and ends the episode.

It gives no reward itself (score the final answer with a reward function) and counts, per trajectory,
`tool_calls` and `tool_errors` (calls that could not be run, tool answers starting with "error:", calls that
ran past `timeout_s`, and calls past `max_calls_per_turn`, which are answered with the cap instead of run).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_rl.rollout.agent.env import Observation, StepResult
from megatron_rl.rollout.agent.tool_calls import ToolCall, get_tool_call_format
from megatron_rl.rollout.agent.tools import Tool, get_tool
from megatron_rl.rollout.prompts import Prompt


class ToolEnv:
    def __init__(
        self,
        tools: Sequence[str] = ("calculator",),
        tool_call_format: str = "hermes",
        tool_options: Mapping[str, Mapping[str, Any]] | None = None,
        timeout_s: float | None = 30.0,
        max_calls_per_turn: int = 8,
    ):
        """`tools`: registered names or dotted paths (the model calls each by its `name`); `tool_options`: keyword
        options per tool, keyed as in `tools`, e.g. ``{"python": {"timeout_s": 5}}``; `timeout_s`: the longest any
        one call may take before its answer is an error (None: no limit); `max_calls_per_turn`: calls of one turn
        that are run (they run one after another), later ones are answered with an error naming the cap."""
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"tools environment: timeout_s must be > 0 seconds or null (no limit), got {timeout_s}")
        if not (isinstance(max_calls_per_turn, int) and max_calls_per_turn >= 1):
            raise ValueError(
                f"tools environment: max_calls_per_turn must be an integer >= 1, got {max_calls_per_turn!r}"
            )
        options = tool_options or {}
        built = [get_tool(name, **options.get(name, {})) for name in tools]
        self.tools = {tool.name: tool for tool in built}
        if len(self.tools) < len(built):
            names = [tool.name for tool in built]
            raise ValueError(f"tools environment: two tools share a name in {list(tools)} (names {names})")
        self.format = get_tool_call_format(tool_call_format)
        self.timeout_s, self.max_calls_per_turn = timeout_s, max_calls_per_turn
        # What the run should be told every step (e.g. a tool running without isolation), once per distinct text.
        self.warnings = list(dict.fromkeys(w for tool in built if (w := getattr(tool, "warning", None))))

    def reset(self, prompt: Prompt) -> Observation:
        return prompt.token_ids

    def step(self, text: str, token_ids: list[int]) -> StepResult:
        calls = self.format.parse(text, self.tools.keys())
        if not calls:
            return StepResult("", done=True)
        cap = self.max_calls_per_turn
        over = f"error: not run: a turn may make at most {cap} tool calls (rollout.env_options.max_calls_per_turn)"
        results = [
            over
            if k >= cap
            else call_with_timeout(self.tools[c.name], c.arguments, self.timeout_s)
            if isinstance(c, ToolCall)
            else c.message
            for k, c in enumerate(calls)
        ]
        errors = sum(result.startswith("error:") for result in results)
        return StepResult(self.format.format_results(results), info={"tool_calls": len(calls), "tool_errors": errors})


def call_with_timeout(tool: Tool, arguments: Mapping[str, Any], timeout_s: float | None) -> str:
    """The tool's answer, or an error answer when the call takes longer than `timeout_s`. Python cannot stop a
    thread: a call past its time finishes (or hangs) in a daemon thread and its answer is dropped. Tools that run
    code bound themselves in the kernel (the `python` tool kills its process group at its own `timeout_s`). An
    exception from the tool (a bug in it, not the model's input) is raised here."""
    if timeout_s is None:
        return tool(arguments)
    outcome: list[tuple[bool, Any]] = []

    def call() -> None:
        try:
            outcome.append((True, tool(arguments)))
        except BaseException as err:  # re-raised on the rollout's thread
            outcome.append((False, err))

    worker = threading.Thread(target=call, name=f"tool-{tool.name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not outcome:
        return f"error: {tool.name} did not answer within {timeout_s:g} s"
    ok, value = outcome[0]
    if not ok:
        raise value
    return value
