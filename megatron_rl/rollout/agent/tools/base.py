"""The tool interface and registry: a tool takes a call's JSON arguments and answers with text."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from megatron_rl.rollout.plugins import lookup, register_in


class Tool(Protocol):
    """A tool the model may call. `parameters` is the JSON schema of its arguments (what chat templates render
    from `tools=[tool_schema(tool)]`). Calling it never raises for bad input: errors are answers the model reads."""

    name: str
    description: str
    parameters: dict[str, Any]

    def __call__(self, arguments: Mapping[str, Any]) -> str: ...


ToolFactory = Callable[..., Tool]  # a class, called with the tool's options (limits, timeouts) as keywords
TOOLS: dict[str, ToolFactory] = {}


def register_tool(name: str) -> Callable[[ToolFactory], ToolFactory]:
    """Decorator: make the tool class available as `get_tool(name)`."""
    return register_in(TOOLS, "tool", name)


def get_tool(name: str, **options: Any) -> Tool:
    """A registered tool or a dotted path to a tool class, built with `options`."""
    return lookup(name, TOOLS, "tool")(**options)


def tool_schema(tool: Tool) -> dict[str, Any]:
    """The OpenAI-style function description chat templates take in `tools=`."""
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
    }


def string_argument(arguments: Mapping[str, Any], key: str) -> str | None:
    """`arguments[key]` when it is a string, else None (the caller answers with an error)."""
    value = arguments.get(key)
    return value if isinstance(value, str) else None
