"""The in-process and child-process rollout engines, their sampling, weight loading and the engine factory."""
