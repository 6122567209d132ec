"""DAPO dynamic sampling, overlong shaping and filtering in `collect_batch` (scripted engine + one real run)."""

from __future__ import annotations

import logging

import pytest

from megatron_rl.config.sampling import SamplingParams
from megatron_rl.rollout.dynamic_sampling import OverlongOptions, collect_batch
from megatron_rl.rollout.engines.local_engine import LocalEngine
from megatron_rl.rollout.prompts import Prompt
from megatron_rl.rollout.sample import Sample
from megatron_rl.rollout.tasks.synthetic_task import SyntheticTask

N = 4


class ScriptedEngine:
    """Responses scripted by the prompt's answer: "<rewards>/<lengths>/<finish>", e.g. "1010/2222/ssss"."""

    weight_version = "v0"

    def __init__(self, prompts: dict[int, Prompt]):
        self.by_id = prompts
        self.calls = 0

    def generate(self, prompts, params, *, n=1, return_routed_experts=False):
        self.calls += 1
        out = []
        for i, ids in enumerate(prompts):
            rewards, lengths, finish = self.by_id[ids[0]].answer.split("/")
            finish_names = {"s": "stop", "l": "length", "a": "abort"}
            for j in range(n):
                length = int(lengths[j])
                out.append(
                    Sample(
                        ids, [7] * length, [0.0] * length, finish_names[finish[j]], "v0", i, metadata={"r": rewards[j]}
                    )
                )
        return out


def reward(sample: Sample, text: str, metadata) -> float:
    return float(metadata["r"])


def source(scripts: list[str]):
    prompts = {k: Prompt(f"p{k}", [k], script, {"k": k}) for k, script in enumerate(scripts)}
    return ScriptedEngine(prompts), iter(prompts.values())


def run(scripts, *, batch_prompts=2, max_tries=5, dynamic=True, overlong=None, per_try=None, tokenizer=None):
    engine, prompts = source(scripts)
    batch = collect_batch(
        engine, prompts, N, batch_prompts, SamplingParams(), reward,
        tokenizer=tokenizer, dynamic_sampling=dynamic, max_tries=max_tries, overlong=overlong, prompts_per_try=per_try,
    )  # fmt: skip
    return engine, batch


MIXED, ALL1, ALL0 = "1010/2222/ssss", "1111/2222/ssss", "0000/2222/ssss"


def test_keeps_drawing_until_full(tokenizer):
    engine, batch = run([ALL1, MIXED, ALL0, ALL0, ALL1, "0001/2222/ssss", MIXED], tokenizer=tokenizer)
    # tries of 2 prompts: (ALL1, MIXED) keeps 1; (ALL0, ALL0) keeps 0; (ALL1, 0001) keeps 1 -> full
    assert (batch.tries, batch.kept_groups, batch.dropped_groups, batch.filled) == (3, 2, 4, True)
    assert engine.calls == 3 and len(batch.samples) == 2 * N
    assert [s.metadata["k"] for s in batch.samples] == [1] * N + [5] * N
    assert [s.group_index for s in batch.samples] == [0] * N + [1] * N
    assert [s.reward for s in batch.samples] == [1, 0, 1, 0, 0, 0, 0, 1]
    assert batch.samples[0].metadata["prompt"] == "p1" and batch.samples[0].metadata["answer"] == MIXED
    assert batch.reward_stats.count == 6 * N and batch.reward_stats.total == 2 + 4 + 4 + 1


def test_gives_up_after_max_tries(tokenizer, caplog):
    with caplog.at_level(logging.WARNING):
        engine, batch = run([ALL0, ALL1] * 10, max_tries=3, tokenizer=tokenizer)
    assert (batch.tries, batch.kept_groups, batch.dropped_groups, batch.filled) == (3, 0, 6, False)
    assert batch.samples == [] and engine.calls == 3
    assert "batch not filled: 0 of 2 groups kept after 3 tries" in caplog.text


def test_without_dynamic_sampling_keeps_everything_but_aborted_groups(tokenizer):
    _, batch = run([ALL0, "1111/2222/ssas", ALL1, MIXED], dynamic=False, tokenizer=tokenizer)
    assert (batch.tries, batch.kept_groups, batch.aborted_groups, batch.filled) == (2, 2, 1, True)
    assert [s.metadata["k"] for s in batch.samples[::N]] == [0, 2]


def test_surplus_groups_are_cut_and_source_exhaustion_ends(tokenizer):
    _, batch = run([MIXED] * 5, per_try=5, tokenizer=tokenizer)
    assert (batch.tries, batch.kept_groups, len(batch.samples)) == (1, 2, 2 * N)
    _, batch = run([MIXED], tokenizer=tokenizer)
    assert (batch.tries, batch.kept_groups, batch.filled) == (1, 1, False)


def test_overlong_shaping_and_filtering(tokenizer):
    overlong = OverlongOptions(max_len=8, cache_len=4, factor=1.0, filter_truncated=True)
    # task rewards all 1 but lengths differ: shaped rewards differ, yet the group is dropped (filter on task reward)
    scripts = ["1111/2678/sssl", "1100/4568/ssss", "0000/9999/llll"]
    _, batch = run(scripts, batch_prompts=2, max_tries=1, per_try=3, overlong=overlong, tokenizer=tokenizer)
    assert (batch.kept_groups, batch.dropped_groups) == (1, 2)
    kept = batch.samples
    assert [s.metadata["task_reward"] for s in kept] == [1, 1, 0, 0]
    assert [s.reward for s in kept] == pytest.approx([1.0, 1 - 0.25, -0.5, -1.0])  # lengths 4 5 6 8
    assert [s.exclude_from_loss for s in kept] == [False] * 4
    _, batch = run(["1010/2229/sssl"], batch_prompts=1, overlong=overlong, tokenizer=tokenizer)
    assert [s.exclude_from_loss for s in batch.samples] == [False, False, False, True]
    assert batch.samples[3].reward == pytest.approx(0.0 - 1.0)


def test_rejects_dynamic_sampling_with_one_sample(tokenizer):
    engine, prompts = source([MIXED])
    with pytest.raises(ValueError, match="n_samples >= 2"):
        collect_batch(
            engine, prompts, 1, 1, SamplingParams(), reward, tokenizer=tokenizer, dynamic_sampling=True, max_tries=1
        )


def test_with_local_engine_on_the_synthetic_task(engine: LocalEngine, tokenizer):
    task = SyntheticTask(seed=0)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=0)
    batch = collect_batch(
        engine, task.stream(), 2, 3, params, "synthetic",
        tokenizer=tokenizer, dynamic_sampling=False, max_tries=1, return_routed_experts=True,
    )  # fmt: skip
    assert (batch.kept_groups, batch.filled, len(batch.samples)) == (3, True, 6)
    assert [s.group_index for s in batch.samples] == [0, 0, 1, 1, 2, 2]
    assert all(s.reward == 0.0 and s.routed_experts is not None for s in batch.samples)  # a random model
    assert [s.metadata["answer"] for s in batch.samples[::2]] == [p.answer for p in SyntheticTask(seed=0).prompts(3)]
