"""The built-in tasks `data.train` and `data.eval` may name, and where their classes live (imported when used)."""

SYNTHETIC_TASKS = {
    "synthetic": "megatron_rl.rollout.tasks.synthetic_task:SyntheticTask",  # digit reversal (the demo)
    "synthetic_tool": "megatron_rl.rollout.tasks.synthetic_tool_task:ToolTask",  # the tool-use task
}
