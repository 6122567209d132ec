"""Multi-turn rollouts through an engine: the tool environment, and per-turn engine log-probs aligned to the final
sequence (local engine against teacher forcing of that sequence)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_rl.config.sampling import SamplingParams, TurnLimits
from megatron_rl.rollout.agent.env import StepResult, get_env
from megatron_rl.rollout.agent.multi_turn import generate_with_envs
from megatron_rl.rollout.agent.tool_env import ToolEnv
from megatron_rl.rollout.engines.local_engine import LocalEngine
from megatron_rl.rollout.prompts import Prompt
from megatron_rl.rollout.sample import Sample

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>'


def test_tool_env_runs_calls_and_ends_on_an_answer():
    options = {"python": {"timeout_s": 10.0, "isolation": "none"}}  # not run here: no bubblewrap needed
    env = get_env("tools")(tools=["calculator", "python"], tool_options=options)
    assert isinstance(env, ToolEnv) and env.tools["python"].timeout_s == 10.0
    bad = '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
    result = env.step(CALL + "\n" + bad + "<|im_end|>", [])
    assert result == StepResult(
        "\n<|im_start|>user\n<tool_response>\n84\n</tool_response>\n<tool_response>\nerror: unknown tool 'search'; "
        "available: calculator, python\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        info={"tool_calls": 2, "tool_errors": 1},
    )
    assert env.step("84<|im_end|>", []) == StepResult("", done=True)


def test_calls_past_the_cap_of_a_turn_are_answered_with_the_cap_not_run():
    env = ToolEnv(tools=["calculator"], tool_call_format="compact", max_calls_per_turn=2)
    result = env.step("[calculator:1+1][calculator:2+2][calculator:3+3][calculater:1]", [])
    cap = "error: not run: a turn may make at most 2 tool calls (rollout.env_options.max_calls_per_turn)"
    assert result == StepResult(f"=2\n=4\n={cap}\n={cap}\n", info={"tool_calls": 4, "tool_errors": 2})
    assert ToolEnv().max_calls_per_turn == 8
    with pytest.raises(ValueError, match="max_calls_per_turn must be an integer >= 1, got 0"):
        ToolEnv(max_calls_per_turn=0)


class SleepTool:
    """A user tool by dotted path that may take long (a web search, a slow service)."""

    name = "sleep"
    description = "sleeps for `seconds`"
    parameters = {"type": "object", "properties": {"seconds": {"type": "number"}}}

    def __call__(self, arguments):
        if arguments["seconds"] < 0:
            raise RuntimeError("a bug in the tool")
        time.sleep(arguments["seconds"])  # simulated work: the slow service
        return "awake"


def _sleep_call(seconds: float) -> str:
    return f'<tool_call>{{"name": "sleep", "arguments": {{"seconds": {seconds}}}}}</tool_call>'


def test_a_call_past_the_timeout_is_an_error_answer_and_the_others_run():
    env = get_env("tools")(tools=["calculator", "tests.rollout.test_multi_turn:SleepTool"], timeout_s=0.3)
    assert sorted(env.tools) == ["calculator", "sleep"]  # the model calls a dotted-path tool by its name
    start = time.monotonic()
    result = env.step(_sleep_call(20) + CALL, [])
    assert time.monotonic() - start < 3.0
    assert "<tool_response>\nerror: sleep did not answer within 0.3 s\n</tool_response>" in result.observation
    assert "<tool_response>\n84\n</tool_response>" in result.observation
    assert result.info == {"tool_calls": 2, "tool_errors": 1}
    assert env.step(_sleep_call(0.01), []).info == {"tool_calls": 1, "tool_errors": 0}
    with pytest.raises(RuntimeError, match="a bug in the tool"):  # the tool's own failure is not the model's
        env.step(_sleep_call(-1), [])
    unlimited = get_env("tools")(tools=["tests.rollout.test_multi_turn:SleepTool"], timeout_s=None)
    assert "awake" in unlimited.step(_sleep_call(0.5), []).observation


class ScriptedEngine:
    """A `RolloutEngine` that answers turn t with the t-th text of its script (log-prob -0.5 per token)."""

    def __init__(self, tokenizer, script: list[str]):
        self.tokenizer, self.script = tokenizer, script
        self.seen: list[tuple[list[list[int]], SamplingParams]] = []
        self.weight_version = "v0"

    def generate(self, prompts, params, *, n=1, return_routed_experts=False):
        self.seen.append((prompts, params))
        ids = self.tokenizer(self.script[len(self.seen) - 1], add_special_tokens=False)["input_ids"][
            : params.max_new_tokens
        ]
        return [Sample(p, list(ids), [-0.5] * len(ids), "stop", f"v{len(self.seen)}") for p in prompts]


def test_tool_trajectory_through_an_engine(tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL + "<|im_end|>", "84<|im_end|>"])
    prompt = Prompt("q", tokenizer("12*7?", add_special_tokens=False)["input_ids"])
    (t,) = generate_with_envs(
        engine,
        [ToolEnv()],
        [prompt],
        SamplingParams(max_new_tokens=200, seed=5),
        tokenizer,
        TurnLimits(max_turns=4, max_tokens=400),
    )
    observation = "\n<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(t.response_ids) == CALL + "<|im_end|>" + observation + "84<|im_end|>"
    n_call = len(tokenizer(CALL + "<|im_end|>", add_special_tokens=False)["input_ids"])
    n_obs = len(tokenizer(observation, add_special_tokens=False)["input_ids"])
    assert t.loss_mask == [1] * n_call + [0] * n_obs + [1] * 3
    assert t.response_log_probs == [-0.5] * n_call + [0.0] * n_obs + [-0.5] * 3
    assert (t.finish_reason, t.weight_versions, t.metrics) == (
        "stop",
        ["v1", "v2"],
        {"tool_calls": 1, "tool_errors": 0},
    )
    assert engine.seen[1][0] == [t.tokens[: t.response_start + n_call + n_obs]]  # turn 2 continues the sequence
    assert [params.seed for _, params in engine.seen] == [5, 6]


class Echo:
    """Answers every turn with a fixed observation; never done."""

    def reset(self, prompt: Prompt) -> list[int]:
        return prompt.token_ids

    def step(self, text: str, token_ids: list[int]) -> StepResult:
        return StepResult("|obs|", info={"turns": 1})


@pytest.fixture(scope="module")
def hf_model(tiny_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_dir).eval()


@torch.no_grad()
def test_engine_log_probs_of_every_turn_equal_scoring_the_final_sequence(engine: LocalEngine, hf_model, tokenizer):
    prompts = [Prompt("a", [10, 11, 12, 13]), Prompt("b", [20, 21])]
    stop = tuple(range(64, 128))  # about half the vocabulary ends a turn: short turns that stop by themselves
    params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=0, stop_token_ids=stop)
    trajectories = generate_with_envs(engine, [Echo(), Echo()], prompts, params, tokenizer, TurnLimits(3, 200))
    obs = tokenizer("|obs|", add_special_tokens=False)["input_ids"]
    for t in trajectories:
        assert (len(t.turns), t.metrics, t.finish_reason) == (3, {"turns": 3.0}, "length")  # max_turns reached
        assert all(t.response_ids[turn.end - 1] in stop for turn in t.turns)
        for k, turn in enumerate(t.turns[:-1]):  # each observation follows its turn, untrained
            assert t.response_ids[turn.end : t.turns[k + 1].start] == obs
        assert t.loss_mask == [int(any(u.start <= i < u.end for u in t.turns)) for i in range(len(t.response_ids))]
        logits = hf_model(input_ids=torch.tensor([t.tokens[:-1]])).logits[0].float()
        scored = torch.log_softmax(logits[t.response_start - 1 :], -1).gather(-1, torch.tensor(t.response_ids)[:, None])
        mask = np.array(t.loss_mask, dtype=bool)
        assert mask.sum() > 3
        np.testing.assert_allclose(np.array(t.response_log_probs)[mask], scored[:, 0].numpy()[mask], atol=1e-5, rtol=0)
        assert np.all(np.array(t.response_log_probs)[~mask] == 0.0)


def test_token_limit_ends_trajectories_exactly_at_max_tokens(engine: LocalEngine, tokenizer):
    params = SamplingParams(max_new_tokens=50, temperature=1.0, seed=1, stop_token_ids=tuple(range(64, 128)))
    prompts = [Prompt("a", [10, 11, 12]), Prompt("b", [20])]
    trajectories = generate_with_envs(engine, [Echo(), Echo()], prompts, params, tokenizer, TurnLimits(10, 24))
    for t in trajectories:
        assert len(t.tokens) == 24 and t.finish_reason == "length"
        assert len(t.turns) > 1 and len(t.loss_mask) == len(t.response_log_probs) == 24 - len(t.prompt_ids)


@torch.no_grad()
def test_routes_of_a_multi_turn_sequence_equal_a_single_pass_recording(tiny_moe_dir: Path, tokenizer):
    """R3 on the local engine: the final sequence's routes (prefilled observations included) equal the routers'
    top-k of one forward pass over it, at every position."""
    engine = LocalEngine(tiny_moe_dir)
    params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=2, stop_token_ids=tuple(range(64, 128)))
    prompts = [Prompt("a", [10, 11, 12]), Prompt("b", [20, 21, 22, 23, 24])]
    trajectories = generate_with_envs(
        engine, [Echo(), Echo()], prompts, params, tokenizer, TurnLimits(3, 200), return_routed_experts=True
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir).eval()
    routes: list[torch.Tensor] = []
    hooks = [
        m.register_forward_hook(lambda m, i, o: routes.append(o[2]))
        for n, m in model.named_modules()
        if n.endswith("mlp.gate")
    ]
    try:
        for t in trajectories:
            routes.clear()
            model(input_ids=torch.tensor([t.tokens[:-1]]))
            assert len(t.turns) == 3 and t.routed_experts is not None
            assert t.routed_experts.shape == (len(t.tokens) - 1, 3, 2)
            np.testing.assert_array_equal(t.routed_experts, torch.stack(routes, dim=1).numpy())
    finally:
        for h in hooks:
            h.remove()


def _answer_reward(sample: Sample, text: str, metadata: dict) -> float:
    """1.0 when the final turn says "84" (the reward functions of multi-turn tasks read `turn_texts`)."""
    return float(metadata["turn_texts"][-1].removesuffix("<|im_end|>") == "84")


def test_collect_batch_makes_multi_turn_samples_with_masks_and_rewards(tokenizer):
    """`collect_batch` with a `MultiTurnRollout`: n trajectories per prompt as grouped `Sample`s whose loss mask is 0
    exactly on the observation, the environment's reward added to the reward function's, the turns decoded."""
    from megatron_rl.rollout.agent.multi_turn import MultiTurnRollout
    from megatron_rl.rollout.dynamic_sampling import collect_batch

    engine = ScriptedEngine(tokenizer, [CALL + "<|im_end|>", "84<|im_end|>"])
    prompts = iter([Prompt("q", tokenizer("12*7?", add_special_tokens=False)["input_ids"], answer="84")] * 2)
    rollout = MultiTurnRollout(tokenizer, TurnLimits(4, 400), env="tools")
    batch = collect_batch(
        engine, prompts, 2, 2, SamplingParams(max_new_tokens=200), _answer_reward, tokenizer=tokenizer,
        dynamic_sampling=False, max_tries=1, generate=rollout,
    )  # fmt: skip
    assert [s.group_index for s in batch.samples] == [0, 0, 1, 1]
    n_call = len(tokenizer(CALL + "<|im_end|>", add_special_tokens=False)["input_ids"])
    for s in batch.samples:
        n_obs = len(s.response_ids) - n_call - 3
        assert s.loss_mask == [1] * n_call + [0] * n_obs + [1] * 3
        assert s.metadata["turn_texts"] == [CALL + "<|im_end|>", "84<|im_end|>"]
        assert (s.reward, s.metadata["turns"], s.metadata["env_metrics"]) == (
            1.0,
            2,
            {"tool_calls": 1, "tool_errors": 0},
        )
        assert s.metadata["weight_versions"] == [("v1", 0, n_call), ("v2", n_call + n_obs, n_call + n_obs + 3)]


def test_a_tool_without_isolation_is_warned_about_every_step(tmp_path: Path, tokenizer, caplog):
    from megatron_rl.config.loader import load_config
    from megatron_rl.trainer.rollout_phase import prompt_data

    class Stop(Exception):
        pass

    class StoppingEngine:  # the step's generation is not what is tested: only the warning before it
        def generate(self, *args, **kwargs):
            raise Stop

    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "1 + 1?", "answer": "2"}\n')
    options = "rollout.env_options={tools: [python], tool_options: {python: {isolation: none}}}"
    cfg = load_config(overrides=["model.hf_path=unused", f"data.train={train}", "rollout.env=tools", options])
    data = prompt_data(cfg, tokenizer)
    for step in (1, 2):
        with pytest.raises(Stop):
            data.collect(StoppingEngine(), step)
    warned = [r.getMessage() for r in caplog.records if "WITHOUT kernel isolation" in r.getMessage()]
    assert [w.split(":")[0] for w in warned] == ["step 1", "step 2"]


def test_generate_fn_is_called_per_sample_with_its_own_seed(tokenizer):
    from megatron_rl.rollout.agent.multi_turn import MultiTurnRollout
    from megatron_rl.rollout.agent.trajectory import TrajectoryBuilder

    calls = []

    def generate(engine, prompt, params):
        calls.append(params.seed)
        b = TrajectoryBuilder(prompt.token_ids, max_turns=2, max_tokens=50)
        b.add_turn([5, 6], [-0.1, -0.2], "v0", "stop")
        b.add_observation([7])
        b.add_turn([8], [-0.3], "v1", "stop")
        b.credit(0.5, {})
        return b.build(done=True)

    rollout = MultiTurnRollout(tokenizer, TurnLimits(), generate_fn=generate)
    samples = rollout(None, [Prompt("a", [1, 2]), Prompt("b", [3])], SamplingParams(seed=7), 2, False)
    assert calls == [7, 1007, 2007, 3007]
    assert [s.group_index for s in samples] == [0, 0, 1, 1]
    assert samples[2].tokens == [3, 5, 6, 7, 8] and samples[2].loss_mask == [1, 1, 0, 1]
    assert samples[2].response_log_probs == [-0.1, -0.2, 0.0, -0.3] and samples[2].metadata["env_reward"] == 0.5


def test_bad_environment_options_are_named_at_start_up(tokenizer):
    from megatron_rl.rollout.agent.multi_turn import MultiTurnRollout

    with pytest.raises(ValueError, match=r"rollout.env_options=\{'tool': \['calculator'\]\} do not fit environment"):
        MultiTurnRollout(tokenizer, TurnLimits(), env="tools", env_options={"tool": ["calculator"]})
    with pytest.raises(ValueError, match=r"do not fit environment .*timeout_s must be > 0 seconds or null"):
        MultiTurnRollout(tokenizer, TurnLimits(), env="tools", env_options={"timeout_s": 0})
    with pytest.raises(ValueError, match=r"two tools share a name in \['calculator', 'calculator'\]"):
        MultiTurnRollout(tokenizer, TurnLimits(), env="tools", env_options={"tools": ["calculator", "calculator"]})
    with pytest.raises(ValueError, match="exactly one of rollout.env and rollout.generate_fn"):
        MultiTurnRollout(tokenizer, TurnLimits())
