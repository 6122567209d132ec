"""The digit-reversal task: seeded prompts, disjoint held-out split, SFT pairs, reward, ~0 accuracy when random."""

from __future__ import annotations

from megatron_rl.config.sampling import SamplingParams
from megatron_rl.rollout.engines.local_engine import LocalEngine
from megatron_rl.rollout.rewards import compute_rewards
from megatron_rl.rollout.sample import Sample
from megatron_rl.rollout.tasks.synthetic_task import SyntheticTask, is_eval_string, synthetic_reward


def test_prompts_are_seeded_and_resumable(tokenizer):
    task = SyntheticTask(seed=3)
    first = task.prompts(20)
    assert [p.text for p in SyntheticTask(seed=3).prompts(20)] == [p.text for p in first]
    assert [p.text for p in SyntheticTask(seed=4).prompts(20)] != [p.text for p in first]
    for p in first:
        digits = p.text[:-1]
        assert p.text.endswith(">") and digits.isdigit() and 3 <= len(digits) <= 5
        assert p.answer == digits[::-1] and tokenizer.decode(p.token_ids) == p.text
        assert len(p.token_ids) == len(p.text)  # one token per character
    state = task.state_dict()
    following = task.prompts(5)
    resumed = SyntheticTask(seed=3)
    resumed.load_state_dict(state)
    assert [p.text for p in resumed.prompts(5)] == [p.text for p in following]
    stream = SyntheticTask(seed=3).stream()
    assert [next(stream).text for _ in range(20)] == [p.text for p in first]


def test_eval_split_is_held_out():
    task = SyntheticTask(seed=0)
    evals = task.eval_prompts(200)
    assert [p.text for p in evals] == [p.text for p in task.eval_prompts(200)]
    train = {p.text for p in task.prompts(3000)} | {p.prompt for p in task.sft_pairs(3000)}
    assert not train & {p.text for p in evals}
    assert all(is_eval_string(p.text[:-1]) for p in evals)
    assert not any(is_eval_string(t[:-1]) for t in train)
    share = sum(is_eval_string(f"{i:04d}") for i in range(10000)) / 10000
    assert 0.08 < share < 0.12


def test_sft_pairs_end_with_eos(tokenizer):
    pairs = SyntheticTask(seed=0).sft_pairs(4, start=10)
    assert pairs == SyntheticTask(seed=0).sft_pairs(14)[10:]
    for pair in pairs:
        assert pair.answer == pair.prompt[:-1][::-1]
        assert pair.response_ids[-1] == tokenizer.eos_token_id == 2
        assert tokenizer.decode(pair.prompt_ids + pair.response_ids) == pair.prompt + pair.answer + "<|im_end|>"


def test_reward_needs_the_exact_answer_and_a_stop():
    def score(text: str, finish: str) -> float:
        return synthetic_reward(Sample([5], [6], [0.0], finish, "v"), text, {"answer": "4321"})

    assert score("4321", "stop") == 1.0
    assert score(" 4321\n", "stop") == 1.0
    assert score("4321", "length") == 0.0  # truncated: it never learned to stop
    assert score("43210", "stop") == 0.0
    assert score("1234", "stop") == 0.0


def test_random_model_scores_zero(engine: LocalEngine, tokenizer):
    prompts = SyntheticTask(seed=0).eval_prompts(32)
    samples = engine.generate([p.token_ids for p in prompts], SamplingParams(max_new_tokens=8, temperature=0.0))
    for sample, prompt in zip(samples, prompts, strict=True):
        sample.metadata["answer"] = prompt.answer
    stats = compute_rewards(samples, "synthetic", tokenizer)
    assert stats.count == 32 and stats.total == 0.0
