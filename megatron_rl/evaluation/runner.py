"""Scoring the policy on the run's evaluation datasets (`data.eval`): `train` calls it every `data.eval_every`
steps and at step 0, `megatron-rl eval` on a checkpoint; the same code, so the numbers match.

Each dataset is generated with its own sampling settings through the run's rollout function (multi-turn
environments and generate functions included) on whatever engine the run uses, scored with its own reward, and
summarised by `metrics.dataset_metrics` (mean@n, pass@k, maj@k, greedy accuracy, length, truncation). A sample is
correct when its reward is above 0.5 (rewards score a right answer 1). Sampling is seeded by (trainer.seed, the
dataset's name, the step), so an evaluation of the same weights draws the same samples.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from megatron_rl.config.sampling import SamplingParams
from megatron_rl.config.schema import EvalSet
from megatron_rl.evaluation.metrics import dataset_metrics, default_pass_k
from megatron_rl.rollout.data import PromptData
from megatron_rl.rollout.engine import RolloutEngine, RolloutEngineError
from megatron_rl.rollout.sample import Sample
from megatron_rl.rollout.weight_version import version_step

CORRECT_ABOVE = 0.5  # a sample whose reward is above this is correct


@dataclass(frozen=True)
class EvalDataset:
    """One evaluation dataset, resolved: its prompts, reward, sampling settings and metric-key prefix."""

    spec: EvalSet
    prompts: list[Any]
    reward: Any  # a RewardSet
    params: SamplingParams  # without the seed (`eval_seed` gives it per evaluation)
    pass_k: tuple[int, ...]
    prefix: str  # "eval/<name>/" (the list form of data.eval) or "eval/" (the one-dataset form)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def greedy(self) -> bool:
        return self.spec.temperature == 0


def eval_seed(seed: int, dataset: str, step: int) -> int:
    """The sampling seed of dataset `dataset`'s evaluation after step `step` in a run seeded `seed`."""
    return ((seed * 1_000_003 + zlib.crc32(dataset.encode())) * 100_003 + step) % (1 << 62)


class Evaluator:
    """The run's evaluation datasets and how to score them (rank 0, which holds the rollout engine). Built before
    the model, so an unknown reward or an unreadable file is refused at start-up."""

    def __init__(self, data: PromptData, tokenizer: Any):
        """`data`: the run's prompts, with the config sections they were read with (`data.data`: the datasets and
        rewards, `data.rollout.sampling`, `data.seed`)."""
        from megatron_rl.rollout.rewards.scoring import RewardSet

        self.data, self.tokenizer = data, tokenizer
        cfg_data = data.data
        listed = cfg_data.eval_is_list()
        base = data.rollout.sampling
        self.datasets: list[EvalDataset] = []
        for spec in cfg_data.eval_sets():
            if spec.reward is None:
                reward = data.reward_fn
            else:
                answer_key = cfg_data.eval_columns(spec)[1]
                specs = (spec.reward,) if isinstance(spec.reward, str) else spec.reward
                reward = RewardSet.from_specs(
                    specs, failure_limit=cfg_data.reward_failure_limit, answer_column=answer_key or ""
                )
            params = SamplingParams(
                max_new_tokens=spec.max_new_tokens or base.max_new_tokens,
                temperature=spec.temperature,
                top_p=spec.top_p,
                stop_token_ids=base.stop_token_ids,
            )
            self.datasets.append(
                EvalDataset(
                    spec,
                    data.eval_prompts(spec.name),
                    reward,
                    params,
                    spec.pass_k or default_pass_k(spec.n_samples),
                    f"eval/{spec.name}/" if listed else "eval/",
                )
            )

    def evaluate(
        self, engine: RolloutEngine, step: int, on_samples: Callable[[str, list[Sample]], None] | None = None
    ) -> dict[str, float]:
        """Every dataset's metrics after step `step` (`eval/...`, `time/eval/<name>`, `eval/weight_version`);
        `on_samples(name, samples)` receives each dataset's scored samples. An engine that fails is reported and the
        evaluation skipped (`eval/skipped`): the next rollout restarts it and re-sends the weights. A reward failing
        on more than `data.reward_failure_limit` of the samples raises RewardFailureError."""
        metrics = {"eval/weight_version": float(version_step(engine.weight_version, default=-1))}
        for ds in self.datasets:
            try:
                scored, samples = self.score(ds, engine, step)
            except RolloutEngineError as err:
                skipped = f"evaluation skipped: the rollout engine failed ({err}); the next rollout recovers it"
                print(skipped, flush=True)
                return {"eval/skipped": 1.0}
            metrics.update(scored)
            if on_samples is not None:
                on_samples(ds.name, samples)
        return metrics

    def score(self, ds: EvalDataset, engine: RolloutEngine, step: int) -> tuple[dict[str, float], list[Sample]]:
        """Generate dataset `ds` (n samples per prompt, seeded), score it; its metrics and the scored samples."""
        from megatron_rl.rollout.agent.multi_turn import multi_turn_metrics

        t0 = time.perf_counter()
        n = ds.spec.n_samples
        params = replace(ds.params, seed=eval_seed(self.data.seed, ds.name, step))
        samples = self.data.generate(engine, ds.prompts, params, n, False)  # multi-turn with env / generate_fn
        generated = time.perf_counter() - t0
        for i, s in enumerate(samples):
            p = ds.prompts[i // n]
            s.metadata.update(p.metadata, prompt=p.text, answer=p.answer)
        stats = ds.reward.score(samples, self.tokenizer, timeout_s=self.data.data.reward_timeout_s)
        answers = None
        if ds.reward.extracts_answers:
            for s in samples:
                text = self.tokenizer.decode(s.response_ids, skip_special_tokens=True)
                s.metadata["extracted_answer"] = ds.reward.extract_answer(s, text)
            answers = _groups([s.metadata["extracted_answer"] for s in samples], n)
        correct = _groups([s.reward is not None and s.reward > CORRECT_ABOVE for s in samples], n)
        out = dataset_metrics(
            correct,
            pass_k=ds.pass_k,
            answers=answers,
            greedy=ds.greedy,
            response_lengths=[len(s.response_ids) for s in samples],
            truncated=[s.finish_reason == "length" for s in samples],
        )
        out["reward_mean"] = stats.mean
        out.update({k: v for k, v in stats.metrics().items() if k != "reward/failure_limit"})
        if any("turns" in s.metadata for s in samples):  # the trajectories' tool use
            out.update({k.split("/", 1)[1]: v for k, v in multi_turn_metrics(samples).items()})
        metrics = {ds.prefix + k: float(v) for k, v in out.items()}
        metrics[f"time/eval/{ds.name}"] = time.perf_counter() - t0
        metrics[f"time/eval/{ds.name}/generate"] = generated
        return metrics, samples


def _groups(values: list[Any], n: int) -> list[list[Any]]:
    return [values[i : i + n] for i in range(0, len(values), n)]
