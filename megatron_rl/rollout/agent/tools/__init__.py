"""Tools the model may call during a rollout: the registry (`get_tool`) and the shipped, safe tools."""

from megatron_rl.rollout.agent.tools import calculator, python_sandbox
from megatron_rl.rollout.agent.tools.base import TOOLS, Tool, get_tool, register_tool, tool_schema

__all__ = ["TOOLS", "Tool", "calculator", "get_tool", "python_sandbox", "register_tool", "tool_schema"]
