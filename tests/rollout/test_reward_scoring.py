"""Scoring: weighted rewards and their parts, TRL-style functions, where each reward runs, timeouts that kill, and
the failure limit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_rl.config.loader import load_config
from megatron_rl.config.schema import RewardSpec
from megatron_rl.rollout.rewards import RewardFailureError, RewardSet, RewardStats, build_reward, compute_rewards
from megatron_rl.rollout.rewards.user_functions import RewardInput, RewardTask, reward_style, trl_arguments
from megatron_rl.rollout.rewards.worker_pool import WorkerPool, shared_pool
from megatron_rl.rollout.sample import Sample
from tests.rollout import reward_fixtures

FIXTURES = "tests.rollout.reward_fixtures"


def _samples(tokenizer, texts: list[str], **columns: list) -> list[Sample]:
    """One sample per text (the stop token after it, skipped when decoded); `columns` become metadata."""
    samples = []
    for i, text in enumerate(texts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        metadata = {"prompt": f"<|im_start|>user\nquestion {i}<|im_end|>", **{k: v[i] for k, v in columns.items()}}
        samples.append(Sample([5, 6], ids, [-0.5] * len(ids), "stop", "v0", metadata=metadata))
    return samples


def test_weighted_rewards_sum_and_keep_each_part(tokenizer) -> None:
    cfg = load_config(
        overrides=[
            "model.hf_path=unused",
            "data.reward=[{name: exact_match, weight: 2.0}, "
            f"{{name: '{FIXTURES}:marked', weight: 0.5, options: {{bonus: 1.0}}}}]",
        ]
    )
    assert cfg.data.reward_specs()[1] == RewardSpec(f"{FIXTURES}:marked", 0.5, {"bonus": 1.0})
    reward = build_reward(cfg.data)
    assert [(p.name, p.runner) for p in reward.parts] == [("exact_match", "inline"), ("marked", "process")]
    samples = _samples(tokenizer, ["42", "7", "123"], answer=["42", "8", "123"])
    stats = reward.score(samples, tokenizer)
    assert [s.reward_parts for s in samples] == [
        {"exact_match": 1.0, "marked": 3.0},  # len("42") + bonus 1
        {"exact_match": 0.0, "marked": 2.0},
        {"exact_match": 1.0, "marked": 4.0},
    ]
    assert [s.reward for s in samples] == [2.0 * 1 + 0.5 * 3, 0.5 * 2, 2.0 * 1 + 0.5 * 4]
    assert stats.metrics() == {
        "reward/exact_match_mean": pytest.approx(2 / 3),
        "reward/exact_match_errors": 0.0,
        "reward/marked_mean": 3.0,
        "reward/marked_errors": 0.0,
        "reward/failure_limit": 0.1,
    }
    assert stats.mean == pytest.approx((3.5 + 1.0 + 4.0) / 3)
    restored = Sample.from_json(samples[0].to_json())  # a checkpointed async sample keeps its parts
    assert restored.reward_parts == {"exact_match": 1.0, "marked": 3.0}


def test_where_rewards_run(tokenizer) -> None:
    samples = _samples(tokenizer, ["1", "2"])
    compute_rewards(samples, f"{FIXTURES}:worker_pid", tokenizer)
    pids = {s.reward for s in samples}
    assert os.getpid() not in pids and len(pids) >= 1  # a worker process, not this one
    closure = RewardSet.from_specs([lambda sample, text, metadata: 1.0])
    assert closure.parts[0].runner == "thread"
    assert RewardSet.from_specs(["synthetic"]).parts[0].runner == "inline"


def test_trl_style_functions(tokenizer) -> None:
    # Text data: completions are strings; `completion_ids` the response tokens (stop token included).
    samples = _samples(tokenizer, ["ab", "abcd"])
    compute_rewards(samples, f"{FIXTURES}:trl_length", tokenizer)
    assert [s.reward for s in samples] == [3.0, 5.0]
    # Chat data: completions are assistant messages; a None entry is a failure here.
    chat = [{"role": "user", "content": "say 42"}]
    samples = _samples(tokenizer, ["42", "41", "9"], answer=["42", "42", None], prompt_messages=[chat] * 3)
    stats = compute_rewards(samples, f"{FIXTURES}:trl_exact", tokenizer)
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0]
    assert (stats.errors, stats.part_failures) == (1, {"trl_exact": 1})
    assert "returned None" in stats.first_error
    # A wrong number of values fails the whole call.
    stats = compute_rewards(_samples(tokenizer, ["a", "b", "c"]), f"{FIXTURES}:trl_wrong_length", tokenizer)
    assert stats.errors == 3 and "returned 1 rewards for 3 completions" in stats.first_error
    assert compute_rewards([], f"{FIXTURES}:trl_length", tokenizer).count == 0  # no samples, no call


def test_trl_arguments_follow_grpo_trainers_contract(tokenizer) -> None:
    chat = [{"role": "user", "content": "say 42"}]
    samples = _samples(tokenizer, ["42", "7"], answer=["42", "8"], data_source=["a", "b"], prompt_messages=[chat] * 2)
    items = [RewardInput(s, t) for s, t in zip(samples, ["42", "7"], strict=True)]
    kwargs = trl_arguments(reward_fixtures.trl_length, items, answer_column="ground_truth")
    assert kwargs["prompts"] == [chat, chat]
    assert kwargs["completions"] == [[{"role": "assistant", "content": "42"}], [{"role": "assistant", "content": "7"}]]
    assert kwargs["completion_ids"] == [s.response_ids for s in samples]
    assert kwargs["answer"] == kwargs["ground_truth"] == ["42", "8"]  # also under the dataset's column name
    assert kwargs["data_source"] == ["a", "b"] and "prompt" not in kwargs and "prompt_messages" not in kwargs
    # Without **kwargs a function gets only what it names.
    assert set(trl_arguments(reward_fixtures.trl_named, items, "ground_truth")) == {
        "prompts", "completions", "ground_truth", "data_source",
    }  # fmt: skip
    (text,) = _samples(tokenizer, ["x"])  # no prompt messages: text data, prompts are the templated texts
    assert trl_arguments(reward_fixtures.trl_length, [RewardInput(text, "x")])["prompts"] == [text.metadata["prompt"]]


def test_trl_functions_get_a_loaded_chat_rows_messages(tokenizer) -> None:
    """From the loader to the call: a TRL chat dataset's prompts reach a TRL-style reward as message lists."""
    from megatron_rl.rollout.prompts import load_prompts

    fixtures = Path(__file__).parents[1] / "fixtures" / "data"
    prompts = load_prompts(fixtures / "trl_chat.jsonl", tokenizer, answer_key="solution", apply_chat_template=True)
    samples = _samples(tokenizer, ["0", "9"])
    for sample, prompt in zip(samples, prompts, strict=False):
        sample.metadata = {**prompt.metadata, "prompt": prompt.text, "answer": prompt.answer}
    items = [RewardInput(s, t) for s, t in zip(samples, ["0", "9"], strict=True)]
    kwargs = trl_arguments(reward_fixtures.trl_length, items, answer_column="solution")
    assert kwargs["prompts"] == [[{"role": "user", "content": "1-1="}], [{"role": "user", "content": "1-2="}]]
    assert kwargs["completions"] == [[{"role": "assistant", "content": "0"}], [{"role": "assistant", "content": "9"}]]


def test_signatures_and_options_are_checked_at_start() -> None:
    assert reward_style(reward_fixtures.marked, "marked") == "sample"
    assert reward_style(reward_fixtures.trl_exact, "trl_exact") == "batched"
    assert reward_style(lambda **kwargs: [], "kw") == "batched"
    with pytest.raises(ValueError, match=r"signature \(sample: 'Sample', text: 'str'\).*fn\(sample, text, metadata\)"):
        RewardSet.from_specs([f"{FIXTURES}:two_positional"])
    with pytest.raises(ValueError, match=r"reward 'gsm8k' does not accept the options \{'nope': 1\}"):
        RewardSet.from_specs([RewardSpec("gsm8k", options={"nope": 1})])
    RewardSet.from_specs([RewardSpec("gsm8k", options={"strict": True})])


def test_failure_limit_stops_with_the_first_error_and_its_sample(tokenizer) -> None:
    samples = _samples(tokenizer, [f"response {i}" for i in range(8)])
    reward = build_reward(load_config(overrides=["model.hf_path=unused", f"data.reward={FIXTURES}:always_raises"]).data)
    with pytest.raises(RewardFailureError) as failure:
        reward.score(samples, tokenizer)
    message = str(failure.value)
    assert isinstance(failure.value, ValueError) and "\n" not in message
    assert f"reward '{FIXTURES}:always_raises' failed on 8 of 8 samples" in message
    assert "more than data.reward_failure_limit=0.1" in message
    assert "the first: KeyError: 'ground_truth'" in message
    assert "prompt '<|im_start|>user\\nquestion 0<|im_end|>' and response 'response 0'" in message
    # A higher limit trains on with the failures scored 0 (and counted).
    assert "reward_timeout_s" not in message  # nothing timed out
    stats = reward.score(samples, tokenizer, failure_limit=1.0)
    assert [s.reward for s in samples] == [0.0] * 8 and stats.metrics()["reward/always_raises_errors"] == 8.0


@pytest.mark.parametrize(
    "kinds,stops",
    [
        (["raise"] + ["ok"] * 19, False),  # one in 20: 5% <= 10%
        (["ok"] * 18 + ["raise", "none"], False),  # two in 20: exactly the limit, not more
        (["ok"] * 17 + ["text", "none", "nan"], True),  # non-numbers are failures: three in 20
    ],
)
def test_failure_limit_counts(tokenizer, kinds: list[str], stops: bool) -> None:
    samples = _samples(tokenizer, ["abc"] * len(kinds), kind=kinds)
    reward = RewardSet.from_specs([f"{FIXTURES}:marked"], failure_limit=0.1)
    if stops:
        with pytest.raises(RewardFailureError, match=r"failed on 3 of 20 samples.*the first: returned '1.0' \(str\)"):
            reward.score(samples, tokenizer)
        return
    stats = reward.score(samples, tokenizer)
    failed = kinds.count("raise") + kinds.count("none")
    assert stats.part_failures == {"marked": failed} and stats.mean == pytest.approx(3.0 * (20 - failed) / 20)
    assert [s.reward for s in samples] == [0.0 if k != "ok" else 3.0 for k in kinds]


def test_a_hung_reward_is_killed_after_the_timeout(tokenizer) -> None:
    # 40 calls: a worker gets several at once, so calls queued behind the hung one must move to another worker.
    texts = ["a" * (1 + i % 5) for i in range(40)]
    samples = _samples(tokenizer, texts, kind=["hang" if i == 5 else "ok" for i in range(40)])
    pool = shared_pool(2)
    killed = pool.killed
    reward = RewardSet.from_specs([f"{FIXTURES}:marked"], failure_limit=0.5)
    stats = reward.score(samples, tokenizer, timeout_s=2.0, max_workers=2)
    assert [s.reward for s in samples] == [0.0 if i == 5 else float(len(t)) for i, t in enumerate(texts)]
    assert (stats.timeouts, stats.errors, stats.first_error) == (1, 0, "timed out after 2 s")
    assert pool.killed == killed + 1  # the hung worker was killed; every worker left is alive
    assert pool._idle and all(w.process.poll() is None for w in pool._idle)
    # A timeout counts against the limit like any failure.
    with pytest.raises(RewardFailureError, match="failed on 1 of 4 .*timed out after 2 s.*data.reward_timeout_s"):
        RewardSet.from_specs([f"{FIXTURES}:marked"], failure_limit=0.1).score(samples[2:6], tokenizer, timeout_s=2.0)


def test_a_worker_killed_from_outside_is_replaced(tokenizer) -> None:
    pool = WorkerPool(1)
    items = [RewardInput(s, s.metadata["prompt"][-6:]) for s in _samples(tokenizer, ["x"] * 3)]
    tasks = [RewardTask(reward_fixtures.marked, "sample", {}, [item]) for item in items]
    assert pool.run(tasks[:1], timeout_s=60) == [[6.0]]
    (worker,) = pool._alive
    worker.process.kill()  # e.g. the kernel's out-of-memory killer, while it waits for work
    worker.process.wait()
    assert pool.run(tasks, timeout_s=60) == [[6.0]] * 3
    assert (pool.started, pool.killed) == (2, 1)
    pool.close()


def test_workers_follow_a_changed_import_path(tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reward module in a folder put on sys.path after the pool started (a second run's config folder)."""
    compute_rewards(_samples(tokenizer, ["a"]), f"{FIXTURES}:marked", tokenizer)  # the pool's workers are up
    (tmp_path / "late_rewards.py").write_text("def three(sample, text, metadata):\n    return 3.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    samples = _samples(tokenizer, ["a", "b"])
    stats = compute_rewards(samples, "late_rewards:three", tokenizer, failure_limit=0.0)
    assert [s.reward for s in samples] == [3.0, 3.0] and stats.errors == 0


def test_importing_the_rewards_module_is_not_timed(tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module that takes longer to import (torch, a checker) than one call may take: only the calls are timed."""
    (tmp_path / "slow_rewards.py").write_text(
        "import time\ntime.sleep(2.0)  # simulated work: stands for a heavy import\n\n"
        "def one(sample, text, metadata):\n    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    samples = _samples(tokenizer, ["a", "b", "c"])
    stats = compute_rewards(samples, "slow_rewards:one", tokenizer, timeout_s=1.0, failure_limit=0.0)
    assert [s.reward for s in samples] == [1.0, 1.0, 1.0] and stats.timeouts == 0


def test_a_pool_closes_every_worker(tokenizer) -> None:
    pool = WorkerPool(2)
    items = [RewardInput(s, "ab") for s in _samples(tokenizer, ["ab", "ab"])]
    tasks = [RewardTask(reward_fixtures.marked, "sample", {}, [item]) for item in items]
    assert pool.run(tasks, timeout_s=60) == [[2.0], [2.0]]
    workers = list(pool._alive)
    assert len(workers) == 2 and all(w.process.poll() is None for w in workers)
    pool.close()
    assert all(w.process.poll() is not None for w in workers) and not pool._alive


def test_stats_merge_parts() -> None:
    a = RewardStats(2, 3.0, 1, 0, "E: x", {"m": 2.0}, {"m": 1}, 0.1)
    b = RewardStats(2, 1.0, 0, 1, "T", {"m": 1.0, "n": 4.0}, {"n": 1})
    total = a + b
    assert (total.count, total.mean, total.errors, total.timeouts, total.first_error) == (4, 1.0, 1, 1, "E: x")
    assert total.metrics() == {
        "reward/m_mean": 0.75,
        "reward/m_errors": 1.0,
        "reward/n_mean": 1.0,
        "reward/n_errors": 1.0,
        "reward/failure_limit": 0.1,
    }
