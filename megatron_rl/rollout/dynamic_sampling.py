"""Collect one training batch of prompt groups: generate, score, shape, and DAPO dynamic sampling.

DAPO (arXiv 2503.14476) Algorithm 1, lines 3-9: sample G responses per prompt, reward them, drop the groups
whose rewards are all equal (they have zero advantage, hence no gradient), and keep sampling until the batch
holds `batch_prompts` groups. Overlong reward shaping (eq. 13) and overlong filtering are applied here too.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from megatron_rl.algorithms import filter_groups, overlong_penalty
from megatron_rl.config.sampling import SamplingParams
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.prompts import Prompt
from megatron_rl.rollout.rewards import RewardFn, RewardStats, compute_rewards
from megatron_rl.rollout.sample import Sample

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OverlongOptions:
    """DAPO's treatment of long responses (eq. 13 and overlong filtering)."""

    max_len: int = field(metadata={"help": "L_max: response length at which the penalty reaches -factor"})
    cache_len: int = field(metadata={"help": "L_cache: length of the soft-penalty ramp before max_len (0 = hard)"})
    factor: float = field(default=1.0, metadata={"help": "penalty at max_len (0 disables the shaping)"})
    filter_truncated: bool = field(
        default=False, metadata={"help": "exclude truncated responses (finish_reason 'length') from the loss"}
    )
    count_prompt: bool = field(
        default=False,
        metadata={"help": "measure the whole sequence, prompt included (multi-turn: max_len = turns.max_tokens)"},
    )

    def __post_init__(self) -> None:
        if not 0 <= self.cache_len <= self.max_len:
            raise ValueError(f"need 0 <= cache_len <= max_len, got cache_len={self.cache_len}, max_len={self.max_len}")
        if self.factor < 0:
            raise ValueError(f"factor must be >= 0, got {self.factor}")


# How one try generates: (engine, prompts, params, n, return_routed_experts) -> n samples per prompt, grouped
# prompt by prompt. `generate_single_turn` below; `multi_turn.MultiTurnRollout` for environments.
GenerateBatch = Callable[[RolloutEngine, list[Prompt], SamplingParams, int, bool], list[Sample]]


def generate_single_turn(
    engine: RolloutEngine, prompts: list[Prompt], params: SamplingParams, n: int, return_routed_experts: bool
) -> list[Sample]:
    """One response per sample: the engine's own `generate`."""
    return engine.generate([p.token_ids for p in prompts], params, n=n, return_routed_experts=return_routed_experts)


@dataclass
class RolloutBatch:
    """The outcome of `collect_batch`: the kept groups' samples (group-contiguous) and what it took."""

    samples: list[Sample]
    kept_groups: int
    dropped_groups: int  # all-equal rewards (dynamic sampling)
    aborted_groups: int  # a sample of the group was aborted by the engine
    tries: int  # generate calls made
    filled: bool  # kept_groups == batch_prompts
    reward_stats: RewardStats  # over every scored sample, kept or not


def collect_batch(
    engine: RolloutEngine,
    prompt_source: Iterator[Prompt],
    n_samples: int,
    batch_prompts: int,
    params: SamplingParams,
    reward_fn: str | RewardFn,
    *,
    tokenizer,
    dynamic_sampling: bool,
    max_tries: int,
    overlong: OverlongOptions | None = None,
    prompts_per_try: int | None = None,
    reward_timeout_s: float = 10.0,
    return_routed_experts: bool = False,
    generate: GenerateBatch = generate_single_turn,
) -> RolloutBatch:
    """Generate `n_samples` responses for prompts from `prompt_source` until `batch_prompts` groups are kept.

    Each try draws `prompts_per_try` prompts (default `batch_prompts`) and makes one generate call. Rewards come
    from `reward_fn` (text decoded with `tokenizer`); the group filter uses this task reward, before the overlong
    penalty is added to `sample.reward` (the raw value stays in `metadata["task_reward"]`). Without dynamic
    sampling every group is kept unless the engine aborted one of its samples. After `max_tries` tries (or when
    the prompt source runs out) the groups kept so far are returned with `filled=False`; kept groups beyond
    `batch_prompts` are discarded. Kept samples get `group_index` 0..kept_groups-1 and `metadata` with the
    prompt's fields, "prompt" (text) and "answer". `generate` makes the samples of a try (multi-turn rollouts
    pass `multi_turn.MultiTurnRollout`; an environment's own reward, `metadata["env_reward"]`, is added to the
    reward function's score).
    """
    if dynamic_sampling and n_samples < 2:
        raise ValueError("dynamic sampling drops groups with equal rewards: it needs n_samples >= 2")
    if batch_prompts < 1 or max_tries < 1 or n_samples < 1:
        raise ValueError(
            f"need batch_prompts, max_tries, n_samples >= 1; got {batch_prompts}, {max_tries}, {n_samples}"
        )
    per_try = prompts_per_try or batch_prompts
    kept: list[list[Sample]] = []
    dropped = aborted = tries = 0
    stats = RewardStats()
    while len(kept) < batch_prompts and tries < max_tries:
        prompts = list(itertools.islice(prompt_source, per_try))
        if not prompts:
            logger.warning("prompt source ran out after %d tries", tries)
            break
        tries += 1
        samples = generate(engine, prompts, params, n_samples, return_routed_experts)
        for sample in samples:
            prompt = prompts[sample.group_index]
            sample.metadata.update(prompt.metadata, prompt=prompt.text, answer=prompt.answer)
        stats += compute_rewards(samples, reward_fn, tokenizer, timeout_s=reward_timeout_s)
        for sample in samples:
            sample.reward += sample.metadata.get("env_reward", 0.0)
        _shape_overlong(samples, overlong)
        groups = [samples[i : i + n_samples] for i in range(0, len(samples), n_samples)]
        complete = [g for g in groups if all(s.finish_reason != "abort" for s in g)]
        aborted += len(groups) - len(complete)
        if dynamic_sampling and complete:
            task_rewards = torch.tensor([s.metadata["task_reward"] for g in complete for s in g])
            keep = filter_groups(task_rewards, n_samples).tolist()
            dropped += keep.count(False)
            complete = [g for g, k in zip(complete, keep, strict=True) if k]
        kept.extend(complete)
    kept = kept[:batch_prompts]
    for index, group in enumerate(kept):
        for sample in group:
            sample.group_index = index
    filled = len(kept) == batch_prompts
    if not filled:
        logger.warning(
            "batch not filled: %d of %d groups kept after %d tries (%d dropped for equal rewards, %d aborted)",
            len(kept),
            batch_prompts,
            tries,
            dropped,
            aborted,
        )
    return RolloutBatch(
        samples=[s for g in kept for s in g],
        kept_groups=len(kept),
        dropped_groups=dropped,
        aborted_groups=aborted,
        tries=tries,
        filled=filled,
        reward_stats=stats,
    )


def _shape_overlong(samples: list[Sample], overlong: OverlongOptions | None) -> None:
    """Keep the task reward in metadata, add the overlong penalty, mark truncated samples for filtering."""
    for sample in samples:
        sample.metadata["task_reward"] = sample.reward
    if overlong is None:
        return
    lengths = torch.tensor([len(s.tokens if overlong.count_prompt else s.response_ids) for s in samples])
    penalties = overlong_penalty(lengths, overlong.max_len, overlong.cache_len, overlong.factor).tolist()
    for sample, penalty in zip(samples, penalties, strict=True):
        sample.reward += penalty
        sample.exclude_from_loss = overlong.filter_truncated and sample.truncated
