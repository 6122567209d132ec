"""A multi-turn environment for the loop tests (loaded by dotted path `tests.trainer.multi_turn_env:AckEnv`): it
answers each of the first `turns - 1` model turns with a fixed observation and ends the episode after the last.
`reward_per_char` rewards longer turns, so that rewards differ within a group and an update moves the weights."""

from __future__ import annotations

from megatron_rl.rollout.agent.env import Observation, StepResult
from megatron_rl.rollout.prompts import Prompt


class AckEnv:
    def __init__(self, turns: int = 3, observation: str = "|ok|", reward: float = 0.0, reward_per_char: float = 0.0):
        self.turns, self.observation, self.reward, self.reward_per_char = turns, observation, reward, reward_per_char
        self.seen = 0

    def reset(self, prompt: Prompt) -> Observation:
        return prompt.token_ids

    def step(self, text: str, token_ids: list[int]) -> StepResult:
        self.seen += 1
        done = self.seen >= self.turns
        reward = self.reward + self.reward_per_char * len(text)
        return StepResult("" if done else self.observation, reward=reward, done=done, info={"acks": float(not done)})
