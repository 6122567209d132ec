"""Multi-turn rollouts: environments, tool calls, trajectories and the tools the model may call."""
