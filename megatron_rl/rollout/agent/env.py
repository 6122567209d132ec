"""Environments for multi-turn rollouts, and the escape hatch of a user generate function.

An environment plays the world the model talks to: `reset(prompt)` gives the first input, then after every model
turn `step(text, token_ids)` gives the observation (tool output, user reply, with its chat-template glue), a reward
contribution and whether the episode is over. The caller owns the token sequence and its loss mask
(`trajectory.TrajectoryBuilder`); the environment only sees text and ids. This is the split of verl's agent loop
(`AgentLoopBase.run` -> `AgentLoopOutput` with a response mask) and NeMo-RL's environments.

A user who needs full control writes a `GenerateFn` instead: ``generate(engine, prompt, params) -> Trajectory``,
slime's custom generate function (``--custom-generate-function-path``), with the engine itself in hand.

Both are found like rewards: a registered name or a dotted path ("package.module:Class").

A complete environment (it ends the episode after the first answer and rewards a "42"):

    @register_env("answer_42")
    class Answer42:
        def reset(self, prompt: Prompt) -> Observation:
            return prompt.token_ids

        def step(self, text: str, token_ids: list[int]) -> StepResult:
            return StepResult("", reward=float(text.strip() == "42"), done=True)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from megatron_rl.config.sampling import SamplingParams
from megatron_rl.rollout.agent.trajectory import Trajectory
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.plugins import load_dotted, lookup_callable, register_in
from megatron_rl.rollout.prompts import Prompt

Observation = str | list[int]  # text (the caller tokenizes it without adding special tokens) or token ids


@dataclass(frozen=True)
class StepResult:
    """What the environment answers to one model turn."""

    observation: Observation  # appended to the sequence untrained (loss mask 0); "" or [] when there is none
    reward: float = 0.0  # this turn's contribution; the episode's reward is the sum (plus any reward function's)
    done: bool = False  # the episode is over: no further model turn
    info: dict[str, Any] = field(default_factory=dict)  # counters for metrics (tool calls, tool errors, ...)


@runtime_checkable
class Environment(Protocol):
    """One episode's world; a new instance per trajectory (environments keep state between steps)."""

    def reset(self, prompt: Prompt) -> Observation:
        """The sequence the model starts from (usually `prompt.token_ids`)."""
        ...

    def step(self, text: str, token_ids: list[int]) -> StepResult:
        """React to one model turn: its decoded text and its token ids (stop token included if generated)."""
        ...


EnvFactory = Callable[..., Environment]  # a class, or a function taking the environment's options as keywords
# Built-ins are registered by path: their modules import this one.
ENVIRONMENTS: dict[str, EnvFactory | str] = {"tools": "megatron_rl.rollout.agent.tool_env:ToolEnv"}


def register_env(name: str) -> Callable[[EnvFactory], EnvFactory]:
    """Decorator: make the environment class (or factory) available as `get_env(name)`."""
    return register_in(ENVIRONMENTS, "environment", name)


def get_env(name: str | EnvFactory) -> EnvFactory:
    """A registered name, a dotted path or a factory; call the result with the environment's options (a config's
    keyword arguments) for one episode's environment."""
    return lookup_callable(name, ENVIRONMENTS, "environment", "a class or factory")


class GenerateFn(Protocol):
    """Full control over one rollout (slime's custom generate function): call `engine.generate` as often as
    needed and return the trajectory built with `trajectory.TrajectoryBuilder`. Called once per sample (a group of
    n samples of one prompt is n calls)."""

    def __call__(self, engine: RolloutEngine, prompt: Prompt, params: SamplingParams) -> Trajectory: ...


def get_generate_fn(path: str | GenerateFn) -> GenerateFn:
    """A dotted path ("package.module:generate") or the function itself."""
    fn = path if callable(path) else load_dotted(path, "generate function")
    if not callable(fn):
        raise ValueError(f"generate function {path!r} is a {type(fn).__name__}, not a function")
    return fn
