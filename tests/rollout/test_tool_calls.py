"""Hermes/Qwen3 tool calls: parsing (several per turn), every malformed call an error observation, result glue."""

from __future__ import annotations

import pytest

from megatron_rl.rollout.agent.tool_calls import (
    HermesFormat,
    ToolCall,
    ToolCallError,
    get_tool_call_format,
)

TOOLS = ("calculator", "python")


def test_parses_several_calls_in_order():
    text = (
        "<think>I need two things.</think>\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>\n'
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call><|im_end|>'
    )
    assert HermesFormat().parse(text, TOOLS) == [
        ToolCall("calculator", {"expression": "12*7"}),
        ToolCall("python", {"code": "print(1)"}),  # arguments given as a JSON string are accepted
    ]


def test_a_final_answer_has_no_calls():
    assert HermesFormat().parse("The answer is 84.<|im_end|>", TOOLS) == []


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ('{"name": "calculator", "arguments": {"expression": "1+1"}', "error: the tool call is not valid JSON ("),
        ('["calculator"]', 'error: a tool call must be a JSON object with a "name" and "arguments"'),
        ('{"arguments": {}}', 'error: a tool call must be a JSON object with a "name" and "arguments"'),
        ('{"name": "search", "arguments": {}}', "error: unknown tool 'search'; available: calculator, python"),
        ('{"name": "calculator"}', "error: the call of 'calculator' needs \"arguments\" as a JSON object"),
        ('{"name": "calculator", "arguments": "1+1"}', "error: the call of 'calculator' needs \"arguments\""),
    ],
)
def test_malformed_calls_become_error_observations(payload: str, message: str):
    (call,) = HermesFormat().parse(f"<tool_call>{payload}</tool_call>", TOOLS)
    assert isinstance(call, ToolCallError)
    assert call.message.startswith(message)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ("[" * 100_000 + "]" * 100_000, "error: the tool call nests too deeply to parse"),
        (
            '{"name": "calculator", "arguments": {"expression": ' + "1" * 5000 + "}}",
            "error: the tool call cannot be parsed (Exceeds the limit (4300 digits) for integer string conversion)",
        ),
        ('{"name": "calculator", "arguments": "' + "[" * 100_000 + '"}', "error: the call of 'calculator' needs"),
    ],
)
def test_inputs_that_crashed_the_parser_become_error_observations(payload: str, message: str):
    (call,) = HermesFormat().parse(f"<tool_call>{payload}</tool_call>", TOOLS)
    assert isinstance(call, ToolCallError) and call.message.startswith(message)


def test_unterminated_call_and_good_call_side_by_side():
    text = '<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call> <tool_call>{"name": "calc'
    assert HermesFormat().parse(text, TOOLS) == [
        ToolCall("python", {"code": "1"}),
        ToolCallError("error: <tool_call> without </tool_call>"),
    ]


def test_results_use_qwen3_template_glue():
    # Qwen3's template renders two "tool" messages after an assistant turn (which ends "<|im_end|>\n") as one user
    # turn of <tool_response> blocks, then add_generation_prompt appends "<|im_start|>assistant\n".
    assert HermesFormat().format_results(["84", "error: x"]) == (
        "\n<|im_start|>user\n<tool_response>\n84\n</tool_response>\n<tool_response>\nerror: x\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    no_think = HermesFormat(generation_prompt="<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert no_think.format_results(["1"]).endswith("<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_format_registry():
    assert isinstance(get_tool_call_format("qwen3"), HermesFormat)
    assert isinstance(get_tool_call_format("megatron_rl.rollout.agent.tool_calls:HermesFormat"), HermesFormat)
    with pytest.raises(ValueError, match="unknown tool-call format 'mistral'"):
        get_tool_call_format("mistral")
