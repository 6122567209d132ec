"""The prompts of a run: the training stream (resumable), the evaluation prompts, the reward, SFT pairs."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from megatron_rl.config.schema import AlgoConfig, DataConfig, RolloutConfig, WarmupConfig
from megatron_rl.config.tasks import SYNTHETIC_TASKS

logger = logging.getLogger(__name__)


class PromptData:
    """Training and evaluation prompts, the reward, and the resumable position in the prompt stream."""

    def __init__(
        self,
        data: DataConfig,
        rollout: RolloutConfig,
        algo: AlgoConfig,
        warmup: WarmupConfig,
        *,
        seed: int,
        tokenizer: Any,
        teacher: Any = None,
    ):
        """The sections it reads: `data` (datasets, keys, rewards), `rollout` (sampling, environments), `algo`
        (dynamic sampling, overlong shaping, R3 routes), `warmup` (the SFT examples); `seed`: the run's
        (`trainer.seed`); `teacher`: an engine that scores each training batch for distillation
        (`teacher_scores`)."""
        from megatron_rl.rollout.rewards import build_reward

        self.data, self.rollout, self.algo, self.warmup, self.seed = data, rollout, algo, warmup, seed
        self.tokenizer, self.teacher = tokenizer, teacher
        self.reward_fn = build_reward(data)  # a RewardSet: the weighted rewards, timeouts, failure limit
        self.task = None
        self.train_iter: Any = None  # a PromptIterator (one dataset) or a Mixture of them (data.train: [...])
        self.train_prompts: list[Any] = []  # every dataset's prompts, in data.train's order
        self.generate = _generate_batch(rollout, tokenizer)
        sources = data.train_sources()  # a built-in task comes alone (config validation refuses a mix)
        if sources[0].path in SYNTHETIC_TASKS:
            self.task = _synthetic(self, sources[0].path)
            self.stream = self.task.stream()
        else:
            from megatron_rl.data.mixture import Mixture
            from megatron_rl.rollout.prompts import PromptIterator

            # Dataset k draws its epochs with seed + k; one dataset keeps the plain iterator (and its state format).
            keys = data.prompt_key, data.answer_key
            datasets = [self._load_prompts(s.path, prompt_key=keys[0], answer_key=keys[1]) for s in sources]
            iterators = [PromptIterator(p, seed=seed + k) for k, p in enumerate(datasets)]
            self.train_prompts = [p for d in datasets for p in d]
            weights = [s.weight for s in sources]
            mixture = len(iterators) > 1
            self.train_iter = Mixture(iterators, weights, seed=seed) if mixture else iterators[0]
            self.stream = self.train_iter
        # Each evaluation dataset's prompts (data.eval; the first `prompts` rows), by name.
        self._eval: dict[str, list[Any]] = {e.name: self._eval_rows(e) for e in data.eval_sets()}
        data_sources = getattr(self, "data_sources", None)  # `auto` refuses rows it cannot route, at start-up
        if data_sources is not None and self.reward_fn.routes_by_data_source:
            self.reward_fn.check_data_sources(data_sources())

    def collect(self, engine: Any, step: int) -> Any:
        """One step's rollout batch; sampling is seeded per step so a resumed run draws the same samples."""
        from megatron_rl.rollout.dynamic_sampling import OverlongOptions, collect_batch, generate_single_turn

        algo, rollout = self.algo, self.rollout
        for warning in getattr(self.generate, "warnings", ()):  # e.g. a code tool running without isolation
            logger.warning("step %d: %s", step, warning)
        overlong = None
        if algo.overlong_buffer > 0 or algo.overlong_filter:
            multi_turn = self.generate is not generate_single_turn  # a trajectory's limit is on all its tokens
            overlong = OverlongOptions(
                max_len=rollout.turns.max_tokens if multi_turn else rollout.sampling.max_new_tokens,
                cache_len=algo.overlong_buffer,
                factor=algo.overlong_penalty_factor if algo.overlong_buffer > 0 else 0.0,
                filter_truncated=algo.overlong_filter,
                count_prompt=multi_turn,
            )
        batch = collect_batch(
            engine,
            self.stream,
            rollout.n_samples,
            rollout.prompts_per_step,
            replace(rollout.sampling, seed=(rollout.sampling.seed or self.seed) * 100_003 + step),
            self.reward_fn,
            tokenizer=self.tokenizer,
            dynamic_sampling=algo.dynamic_sampling,
            max_tries=algo.max_dynamic_tries,
            overlong=overlong,
            reward_timeout_s=self.data.reward_timeout_s,
            return_routed_experts=algo.routing_replay == "R3",
            generate=self.generate,
        )
        if self.teacher is not None:
            from megatron_rl.rollout.teacher_scores import add_teacher_log_probs

            add_teacher_log_probs(self.teacher, batch.samples, top_k=self.algo.distill.top_k)
        return batch

    def eval_prompts(self, name: str) -> list[Any]:
        """The prompts of the evaluation dataset `name` (`data.eval`)."""
        if name not in self._eval:
            raise ValueError(f"no evaluation dataset named {name!r}: data.eval has {sorted(self._eval)}")
        return self._eval[name]

    def _eval_rows(self, spec: Any) -> list[Any]:
        n = spec.prompts or self.data.eval_prompts
        if spec.path in SYNTHETIC_TASKS:
            task = self.task if spec.path == self.data.train_sources()[0].path else None
            return (task or _synthetic(self, spec.path)).eval_prompts(n)
        prompt_key, answer_key = self.data.eval_columns(spec)
        return self._load_prompts(spec.path, prompt_key=prompt_key, answer_key=answer_key)[:n]

    def _load_prompts(self, path: str, *, prompt_key: str, answer_key: str | None) -> list[Any]:
        """The rows of `path` as prompts (`prompts.load_prompts`)."""
        from megatron_rl.rollout.prompts import load_prompts

        return load_prompts(
            path,
            self.tokenizer,
            prompt_key=prompt_key,
            answer_key=answer_key,
            apply_chat_template=self.data.apply_chat_template,
        )

    def _file_prompts(self) -> list[Any]:
        """The training and evaluation prompts read from files (none for the built-in tasks)."""
        files = [e.name for e in self.data.eval_sets() if e.path not in SYNTHETIC_TASKS]
        return self.train_prompts + [p for name in files for p in self._eval[name]]

    def data_sources(self) -> set[str]:
        """The distinct `data_source` values of the training and evaluation rows (rows without one add nothing)."""
        return {str(p.metadata["data_source"]) for p in self._file_prompts() if p.metadata.get("data_source")}

    def longest_prompt(self, eval_set: str | None = None) -> tuple[int, str]:
        """The most tokens of any training or evaluation prompt (of the evaluation dataset `eval_set` alone, if
        given) and where it is (`"train.parquet row 17"`); (0, "") for the built-in tasks."""
        prompts = self._file_prompts() if eval_set is None else self._eval[eval_set]
        return max(((len(p.token_ids), p.origin) for p in prompts), key=lambda t: t[0], default=(0, ""))

    def probe_prompts(self, tokens: int = 256) -> list[list[int]]:
        """The weight-sync probe (`sync_probe.probe_prompts`): token ids of the first training prompts (a built-in
        task's first held-out ones), `tokens` in all."""
        from megatron_rl.rollout.sync_probe import probe_prompts

        rows = self.train_prompts if self.task is None else self.task.eval_prompts(max(8, tokens // 4))
        return probe_prompts((p.token_ids for p in rows), tokens)

    def sft_source(self) -> Any:
        """The warm-up's examples (`open_sft_source`: `warmup.data`, default `data.train`), read on first use."""
        if getattr(self, "_sft", None) is None:
            self._sft = open_sft_source(self.warmup, self.data, self.seed, self.tokenizer, train_task=self.task)
        return self._sft

    def sft_pairs(self, n: int, *, start: int):
        """Examples `start` .. `start + n - 1` of the warm-up's stream."""
        return self.sft_source().sft_pairs(n, start=start)

    def state_dict(self) -> dict:
        return {
            "synthetic": self.task.state_dict() if self.task else None,
            "prompts": self.train_iter.state_dict() if self.train_iter else None,
        }

    def load_state_dict(self, state: dict | None) -> None:
        if not state:
            return
        if self.task is not None and state.get("synthetic"):
            self.task.load_state_dict(state["synthetic"])
        if self.train_iter is not None and state.get("prompts"):
            self.train_iter.load_state_dict(state["prompts"])


def _synthetic(data: PromptData, name: str | None = None):
    """The built-in task `name` (default: `data.train`)."""
    from megatron_rl.rollout.plugins import load_dotted

    task_class = load_dotted(SYNTHETIC_TASKS[name or data.data.train_sources()[0].path], "synthetic task")
    return task_class(seed=data.seed, tokenizer=data.tokenizer)


def open_sft_source(
    warmup: WarmupConfig, data: DataConfig, seed: int, tokenizer: Any, *, train_task: Any = None
) -> Any:
    """The warm-up's examples (an object with `sft_pairs(n, start=)`): a built-in task's SFT split (`train_task`
    when it is the training task), or the rows of `warmup.data` (default: `data.train`) as SFT examples."""
    from megatron_rl.rollout.plugins import load_dotted
    from megatron_rl.rollout.sft_data import SFTDataset

    w = warmup
    name = w.data
    if name is None:
        sources = data.train_sources()
        if len(sources) > 1:
            raise ValueError("data.train is a mixture of datasets: set warmup.data to the file the warm-up trains on")
        name = sources[0].path
    if name in SYNTHETIC_TASKS:
        if train_task is not None and name == data.train:
            return train_task
        return load_dotted(SYNTHETIC_TASKS[name], "synthetic task")(seed=seed, tokenizer=tokenizer)
    return SFTDataset.from_file(
        name,
        tokenizer,
        prompt_key=w.prompt_key or data.prompt_key,
        response_key=w.response_key,
        apply_chat_template=data.apply_chat_template,
        seed=seed,
    )


def _generate_batch(rollout: RolloutConfig, tokenizer: Any):
    """How a rollout try generates: single-turn, or multi-turn with `rollout.env` / `rollout.generate_fn`."""
    from megatron_rl.rollout.dynamic_sampling import generate_single_turn

    if rollout.env is None and rollout.generate_fn is None:
        return generate_single_turn
    from megatron_rl.rollout.agent.multi_turn import MultiTurnRollout

    return MultiTurnRollout(
        tokenizer, rollout.turns, env=rollout.env, env_options=rollout.env_options, generate_fn=rollout.generate_fn
    )
