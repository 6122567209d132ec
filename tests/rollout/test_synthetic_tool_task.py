"""The tool-use task: the compact tool-call format, SFT trajectories with their loss mask (equal to a rollout's),
the reward, the held-out split, and the warm-up batch's mask."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config.sampling import SamplingParams, TurnLimits
from megatron_rl.rollout.agent.multi_turn import generate_with_envs
from megatron_rl.rollout.agent.tool_calls import CompactFormat, ToolCall, ToolCallError, get_tool_call_format
from megatron_rl.rollout.agent.tool_env import ToolEnv
from megatron_rl.rollout.rewards import get_reward
from megatron_rl.rollout.sample import Sample
from megatron_rl.rollout.tasks.synthetic_task import SyntheticTask
from megatron_rl.rollout.tasks.synthetic_tool_task import ENV_OPTIONS, ToolTask, is_eval_problem
from megatron_rl.trainer.warmup import pairs_to_batch

TOOLS = ("calculator", "python")


def test_compact_format_parses_calls_in_order():
    text = "[calculator:37*58][python:print(1)]<|im_end|>"
    assert get_tool_call_format("compact").parse(text, TOOLS) == [
        ToolCall("calculator", {"expression": "37*58"}),
        ToolCall("python", {"code": "print(1)"}),  # the tool's one required argument, from its schema
    ]
    assert CompactFormat().parse("2146<|im_end|>", TOOLS) == []  # an answer
    assert CompactFormat().format_call(ToolCall("calculator", {"expression": "37*58"})) == "[calculator:37*58]"
    assert CompactFormat().format_results(["2146", "error: x"]) == "=2146\n=error: x\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[calculator:37*58", "error: [ without ]"),
        ("[calculator]", "error: a call is [tool:argument]"),
        ("[calc:37*58]", "error: unknown tool 'calc'; available: calculator, python"),
        ("[:1]", "error: unknown tool ''; available: calculator, python"),
    ],
)
def test_compact_format_malformed_calls_become_errors(text: str, message: str):
    assert CompactFormat().parse(text, TOOLS) == [ToolCallError(message)]


def test_compact_env_answers_errors_as_observations():
    env = ToolEnv(**ENV_OPTIONS)
    result = env.step("[calculator:37*]<|im_end|>", [])
    assert result.observation == "=error: not an arithmetic expression\n" and not result.done
    assert result.info == {"tool_calls": 1, "tool_errors": 1}
    result = env.step("[calculator:37*58][calculater:1]<|im_end|>", [])
    assert result.observation == "=2146\n=error: unknown tool 'calculater'; available: calculator\n"
    assert result.info == {"tool_calls": 2, "tool_errors": 1}


def test_sft_pair_trains_exactly_the_model_turns(tokenizer):
    task = ToolTask(seed=0)
    pair = task.sft_pair(task.prompt("sft", 0))
    a, b = (int(x) for x in pair.prompt[:-1].split("*"))
    assert pair.answer == str(a * b) and tokenizer.decode(pair.prompt_ids) == f"{a}*{b}="
    call, observation, answer = f"[calculator:{a}*{b}]<|im_end|>", f"={a * b}\n", f"{a * b}<|im_end|>"
    assert tokenizer.decode(pair.response_ids) == call + observation + answer
    # one token per character, and per special token
    n_call, n_obs, n_answer = len(call) - len("<|im_end|>") + 1, len(observation), len(answer) - len("<|im_end|>") + 1
    assert pair.loss_mask == [1] * n_call + [0] * n_obs + [1] * n_answer


def test_sft_pair_equals_a_rollout_of_the_same_turns(tokenizer):
    """The warm-up trains the sequence and mask a rollout builds: replay the pair's turns through the environment."""
    task = ToolTask(seed=0)
    pairs = task.sft_pairs(3, start=5)
    assert pairs == ToolTask(seed=0).sft_pairs(8)[5:]

    class Replay:  # a RolloutEngine answering with each pair's turns in order
        weight_version = "v"

        def __init__(self, turns):
            self.turns, self.calls = turns, 0

        def generate(self, prompts, params, *, n=1, return_routed_experts=False):
            out = [
                Sample(p, t[self.calls], [0.0] * len(t[self.calls]), "stop", "v")
                for p, t in zip(prompts, self.turns, strict=True)
            ]
            self.calls += 1
            return out

    eos = tokenizer.eos_token_id
    turns = []
    for p in pairs:
        first_end = p.response_ids.index(eos) + 1
        turns.append([p.response_ids[:first_end], p.response_ids[first_end + p.loss_mask.count(0) :]])
    prompts = [task.prompt("sft", k) for k in range(5, 8)]
    trajectories = generate_with_envs(
        Replay(turns),
        [ToolEnv(**ENV_OPTIONS) for _ in pairs],
        prompts,
        SamplingParams(max_new_tokens=24),
        tokenizer,
        TurnLimits(max_turns=3, max_tokens=48),
    )
    for t, p in zip(trajectories, pairs, strict=True):
        assert (t.prompt_ids, t.response_ids, t.loss_mask, t.finish_reason) == (
            p.prompt_ids,
            p.response_ids,
            p.loss_mask,
            "stop",
        )
        assert t.metrics == {"tool_calls": 1, "tool_errors": 0}


def _sample(tokenizer, turns: list[str], observations: list[str], finish_reason="stop") -> tuple[Sample, str]:
    ids: list[int] = []
    for k, turn in enumerate(turns):
        ids += tokenizer(turn, add_special_tokens=False)["input_ids"]
        if k < len(observations):
            ids += tokenizer(observations[k], add_special_tokens=False)["input_ids"]
    sample = Sample([5], ids, [0.0] * len(ids), finish_reason, "v", metadata={"answer": "2146"})
    return sample, tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    ("turns", "finish_reason", "with_turn_texts", "reward"),
    [
        (["[calculator:37*58]<|im_end|>", "2146<|im_end|>"], "stop", True, 1.0),
        (["[calculator:37*58]<|im_end|>", "2146<|im_end|>"], "stop", False, 1.0),  # the last line of the text
        (["[calculator:37*58]<|im_end|>", "2146<|im_end|>"], "length", True, 0.0),  # cut by a limit
        (["[calculator:37*58]<|im_end|>", "21460<|im_end|>"], "stop", True, 0.0),
        (["[calculator:37*58]<|im_end|>", "2146<|im_end|>"][:1], "stop", True, 0.0),  # no answer turn
        (["2146<|im_end|>"], "stop", True, 1.0),  # right without the tool still counts
    ],
)
def test_reward(tokenizer, turns, finish_reason, with_turn_texts, reward):
    sample, text = _sample(tokenizer, turns, ["=2146\n"], finish_reason)
    if with_turn_texts:
        sample.metadata["turn_texts"] = turns
    assert get_reward("synthetic_tool")(sample, text, sample.metadata) == reward


def test_prompts_are_seeded_resumable_and_held_out_disjoint(tokenizer):
    task = ToolTask(seed=3)
    first = task.prompts(20)
    assert [p.text for p in ToolTask(seed=3).prompts(20)] == [p.text for p in first]
    assert [p.text for p in ToolTask(seed=4).prompts(20)] != [p.text for p in first]
    for p in first:
        a, b = (int(x) for x in p.text[:-1].split("*"))
        assert 10 <= a <= 999 and 10 <= b <= 999 and p.answer == str(a * b)
        assert tokenizer.decode(p.token_ids) == p.text and len(p.token_ids) == len(p.text)
    state = task.state_dict()
    following = task.prompts(5)
    resumed = ToolTask(seed=3)
    resumed.load_state_dict(state)
    assert [p.text for p in resumed.prompts(5)] == [p.text for p in following]

    train = {p.text for p in task.prompts(3000)} | {p.prompt for p in task.sft_pairs(3000)}
    held_out = {p.text for p in task.eval_prompts(300)}
    assert not train & held_out and all(is_eval_problem(t) for t in held_out)
    assert not any(is_eval_problem(t) for t in train)


def test_pairs_to_batch_masks_observations():
    single = SyntheticTask(seed=0).sft_pairs(3)
    batch = pairs_to_batch(single)
    assert torch.equal(batch.fields["loss_mask"], batch.response_mask().float())  # plain pairs: unchanged

    pairs = single[:1] + ToolTask(seed=0).sft_pairs(2)
    batch = pairs_to_batch(pairs)
    mask = batch.fields["loss_mask"]
    assert mask.shape == batch.input_ids.shape
    for i, p in enumerate(pairs):
        start, end = len(p.prompt_ids), len(p.prompt_ids) + len(p.response_ids)
        assert mask[i, :start].sum() == 0 and mask[i, end:].sum() == 0
        expected = [1.0] * len(p.response_ids) if p.loss_mask is None else [float(x) for x in p.loss_mask]
        assert mask[i, start:end].tolist() == expected
    assert mask[1].sum() == len(pairs[1].response_ids) - pairs[1].loss_mask.count(0) < len(pairs[1].response_ids)
