"""Environment registry and dotted paths, the 20-line environment of the docs, custom generate functions."""

from __future__ import annotations

import pytest

from megatron_rl.config.sampling import SamplingParams
from megatron_rl.rollout.agent import env as env_module
from megatron_rl.rollout.agent.env import Environment, StepResult, get_env, get_generate_fn, register_env
from megatron_rl.rollout.agent.trajectory import Trajectory, TrajectoryBuilder
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.plugins import load_dotted
from megatron_rl.rollout.prompts import Prompt


class CountDown:
    """Ends after `turns` model turns; every observation is the number of turns left, as token ids."""

    def __init__(self, turns: int = 2):
        self.left = turns

    def reset(self, prompt: Prompt) -> list[int]:
        return prompt.token_ids

    def step(self, text: str, token_ids: list[int]) -> StepResult:
        self.left -= 1
        return StepResult([100 + self.left], reward=float(text == "ok"), done=self.left == 0, info={"turns": 1})


def scripted_generate(engine: RolloutEngine, prompt: Prompt, params: SamplingParams) -> Trajectory:
    """A custom generate function that needs no engine: one fixed turn."""
    b = TrajectoryBuilder(prompt.token_ids, max_turns=1, max_tokens=params.max_new_tokens + len(prompt.token_ids))
    b.add_turn([7, 8], [-0.5, -0.25], "v0", "stop")
    return b.build(done=True)


def test_registry_and_dotted_paths():
    register_env("count_down_test")(CountDown)
    try:
        assert get_env("count_down_test") is CountDown
        assert get_env(f"{__name__}:CountDown") is CountDown
        assert get_env(f"{__name__}.CountDown") is CountDown
        assert get_env(CountDown) is CountDown
        with pytest.raises(ValueError, match="already registered"):
            register_env("count_down_test")(CountDown)
    finally:
        del env_module.ENVIRONMENTS["count_down_test"]
    with pytest.raises(ValueError, match="unknown environment 'nope'"):
        get_env("nope")
    with pytest.raises(ValueError, match=f"cannot load environment '{__name__}:Missing'"):
        get_env(f"{__name__}:Missing")
    with pytest.raises(ValueError, match=f"environment '{__name__}:__doc__' is a str"):
        get_env(f"{__name__}:__doc__")


def test_an_environment_drives_a_trajectory():
    env = get_env(f"{__name__}:CountDown")(turns=2)  # options come in as keywords (a config's)
    assert isinstance(env, Environment)
    b = TrajectoryBuilder(env.reset(Prompt("p", [1, 2])), max_turns=5, max_tokens=50)
    done = False
    for text, ids in (("ok", [5, 6]), ("no", [7])):
        b.add_turn(ids, [-1.0] * len(ids), "v3", "stop")
        result = env.step(text, ids)
        done = result.done
        b.credit(result.reward, result.info)
        if not done:
            b.add_observation(result.observation)
    t = b.build(done=done)
    assert t.tokens == [1, 2, 5, 6, 101, 7] and t.loss_mask == [1, 1, 0, 1]
    assert (t.finish_reason, t.reward, t.metrics) == ("stop", 1.0, {"turns": 2.0})


def test_the_docstring_environment_is_complete():
    namespace: dict = {}
    source = env_module.__doc__.split("A complete environment")[1].split("\n", 1)[1]
    code = "\n".join(line[4:] for line in source.splitlines())
    exec(  # noqa: S102 - the documentation's own example, run as written
        "from megatron_rl.rollout.agent.env import *\nfrom megatron_rl.rollout.prompts import Prompt\n" + code,
        namespace,
    )
    try:
        answer = env_module.ENVIRONMENTS["answer_42"]()
        assert answer.reset(Prompt("q", [3, 4])) == [3, 4]
        assert answer.step(" 42 ", [9]) == StepResult("", reward=1.0, done=True)
        assert answer.step("41", [9]).reward == 0.0
    finally:
        del env_module.ENVIRONMENTS["answer_42"]


def test_custom_generate_function_by_dotted_path():
    fn = get_generate_fn(f"{__name__}:scripted_generate")
    assert fn is scripted_generate
    t = fn(None, Prompt("p", [1]), SamplingParams(max_new_tokens=4))
    assert (t.tokens, t.loss_mask, t.response_log_probs) == ([1, 7, 8], [1, 1], [-0.5, -0.25])
    with pytest.raises(ValueError, match=f"generate function '{__name__}:__name__' is a str, not a function"):
        get_generate_fn(f"{__name__}:__name__")
    with pytest.raises(ValueError, match="is not a dotted path"):
        load_dotted("plain", "reward")
