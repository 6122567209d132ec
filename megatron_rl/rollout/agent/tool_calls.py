"""Tool calls in the model's own chat format: parse them out of a turn, and write tool results back.

A format is per chat template (pluggable by name or dotted path). The first one is Hermes / Qwen2.5 / Qwen3's:
calls are ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (several per turn allowed), results
go back in a user turn of ``<tool_response>...</tool_response>`` blocks, as Qwen3's chat template renders
``role: "tool"`` messages. A call that cannot be run (malformed JSON, unknown tool, missing arguments) is parsed
into a `ToolCallError` whose message becomes that call's result: the model reads its mistake; nothing raises.

The second, "compact", is for character-level demo models, whose every character is a token: a call is
``[tool:argument]`` (the tool's one required argument, e.g. ``[calculator:37*58]``), a result comes back as
``=result`` and a newline, ~20 tokens a round trip where Hermes JSON takes ~75 for the call alone.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol

from megatron_rl.rollout.agent.tools import TOOLS
from megatron_rl.rollout.plugins import lookup


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolCallError:
    message: str  # the observation the model gets instead of a result


ParsedCall = ToolCall | ToolCallError


class ToolCallFormat(Protocol):
    """A chat template's tool-call syntax."""

    def parse(self, text: str, tool_names: Collection[str]) -> list[ParsedCall]:
        """The calls in one generated turn, in order ([] when it makes none: a final answer)."""
        ...

    def format_results(self, results: list[str]) -> str:
        """The observation text after the turn: its results with the template's glue up to the next assistant
        turn's start, so the model continues exactly as after `apply_chat_template(add_generation_prompt=True)`."""
        ...


def unknown_tool(name: str, tool_names: Collection[str]) -> ToolCallError:
    return ToolCallError(f"error: unknown tool {name!r}; available: {', '.join(sorted(tool_names))}")


def check_call(payload: str, tool_names: Collection[str]) -> ParsedCall:
    """Validate one call's JSON payload: an object with a known "name" and an "arguments" object (a JSON string
    holding an object is accepted too, as some models write it)."""
    try:
        call = json.loads(payload)
    except json.JSONDecodeError as err:
        return ToolCallError(f"error: the tool call is not valid JSON ({err.msg} at position {err.pos})")
    except RecursionError:
        return ToolCallError("error: the tool call nests too deeply to parse")
    except ValueError as err:  # e.g. an integer of more digits than int() converts (sys.get_int_max_str_digits)
        return ToolCallError(f"error: the tool call cannot be parsed ({str(err).partition(':')[0]})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCallError('error: a tool call must be a JSON object with a "name" and "arguments"')
    name = call["name"]
    if name not in tool_names:
        return unknown_tool(name, tool_names)
    arguments = call.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # not JSON: refused below as not an object
            pass
    if not isinstance(arguments, dict):
        return ToolCallError(f'error: the call of {name!r} needs "arguments" as a JSON object')
    return ToolCall(name, arguments)


class HermesFormat:
    """Hermes / Qwen2.5 / Qwen3: ``<tool_call>\\n{json}\\n</tool_call>`` and ``<tool_response>`` results in a user
    turn. The glue assumes the turn ended with ``<|im_end|>`` (the template's "\\n" after it is part of the
    observation) and continues with `generation_prompt` (Qwen3 without thinking: add "<think>\\n\\n</think>\\n\\n")."""

    _CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)

    def __init__(self, generation_prompt: str = "<|im_start|>assistant\n"):
        self.generation_prompt = generation_prompt

    def parse(self, text: str, tool_names: Collection[str]) -> list[ParsedCall]:
        calls: list[ParsedCall] = []
        for match in self._CALL.finditer(text):
            if not match[2]:
                calls.append(ToolCallError("error: <tool_call> without </tool_call>"))
            else:
                calls.append(check_call(match[1].strip(), tool_names))
        return calls

    def format_results(self, results: list[str]) -> str:
        blocks = "".join(f"\n<tool_response>\n{result}\n</tool_response>" for result in results)
        return f"\n<|im_start|>user{blocks}<|im_end|>\n{self.generation_prompt}"


class CompactFormat:
    """``[tool:argument]`` calls (several per turn allowed), each answered by ``=result`` and a newline after the
    turn's stop token. The argument is passed as the tool's single required parameter (from its JSON schema), so
    only one-argument tools can be called; no escaping: the argument cannot contain "]"."""

    _CALL = re.compile(r"\[([^\]]*)(\]|$)")

    def parse(self, text: str, tool_names: Collection[str]) -> list[ParsedCall]:
        calls: list[ParsedCall] = []
        for match in self._CALL.finditer(text):
            name, colon, argument = match[1].partition(":")
            if not match[2]:
                calls.append(ToolCallError("error: [ without ]"))
            elif not colon:
                calls.append(ToolCallError("error: a call is [tool:argument]"))
            elif name not in tool_names:
                calls.append(unknown_tool(name, tool_names))
            else:
                calls.append(_single_argument_call(name, argument))
        return calls

    def format_call(self, call: ToolCall) -> str:
        """The text of `call` in this format (its one argument's value), for supervised examples."""
        (argument,) = call.arguments.values()
        return f"[{call.name}:{argument}]"

    def format_results(self, results: list[str]) -> str:
        return "".join(f"={result}\n" for result in results)


def _single_argument_call(name: str, argument: str) -> ParsedCall:
    """`argument` as the one required parameter of tool `name` (a registered name or dotted path)."""
    required = lookup(name, TOOLS, "tool").parameters.get("required", [])
    if len(required) != 1:
        return ToolCallError(f"error: {name!r} takes {len(required)} required arguments; [tool:argument] passes one")
    return ToolCall(name, {required[0]: argument})


TOOL_CALL_FORMATS: dict[str, Callable[[], ToolCallFormat]] = {
    "hermes": HermesFormat,
    "qwen3": HermesFormat,
    "compact": CompactFormat,
}


def get_tool_call_format(name: str) -> ToolCallFormat:
    """A registered format ("hermes", "qwen3", "compact") or a dotted path to a format class."""
    return lookup(name, TOOL_CALL_FORMATS, "tool-call format")()
