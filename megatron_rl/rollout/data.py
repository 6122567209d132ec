"""The prompts of a run: the training stream (resumable), the evaluation prompts, the reward, SFT pairs."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from megatron_rl.config.schema import RLConfig


class PromptData:
    """Training and evaluation prompts, the reward, and the resumable position in the prompt stream."""

    def __init__(self, cfg: RLConfig, tokenizer: Any):
        from megatron_rl.rollout.rewards import get_reward

        self.cfg = cfg
        self.tokenizer = tokenizer
        self.reward_fn = get_reward(cfg.data.reward)
        self.task = None
        self.train_iter = None
        if cfg.data.train == "synthetic":
            from megatron_rl.rollout.synthetic_task import SyntheticTask

            self.task = SyntheticTask(seed=cfg.trainer.seed, tokenizer=tokenizer)
            self.stream = self.task.stream()
        else:
            from megatron_rl.rollout.prompts import PromptIterator, load_prompts

            prompts = load_prompts(
                cfg.data.train,
                tokenizer,
                prompt_key=cfg.data.prompt_key,
                answer_key=cfg.data.answer_key,
                apply_chat_template=cfg.data.apply_chat_template,
            )
            self.train_iter = PromptIterator(prompts, seed=cfg.trainer.seed)
            self.stream = self.train_iter

    def collect(self, engine: Any, step: int) -> Any:
        """One step's rollout batch; sampling is seeded per step so a resumed run draws the same samples."""
        from megatron_rl.rollout.dynamic_sampling import OverlongOptions, collect_batch

        algo, rollout = self.cfg.algo, self.cfg.rollout
        overlong = None
        if algo.overlong_buffer > 0 or algo.overlong_filter:
            overlong = OverlongOptions(
                max_len=rollout.sampling.max_new_tokens,
                cache_len=algo.overlong_buffer,
                factor=algo.overlong_penalty_factor if algo.overlong_buffer > 0 else 0.0,
                filter_truncated=algo.overlong_filter,
            )
        return collect_batch(
            engine,
            self.stream,
            rollout.n_samples,
            rollout.prompts_per_step,
            replace(rollout.sampling, seed=(rollout.sampling.seed or self.cfg.trainer.seed) * 100_003 + step),
            self.reward_fn,
            tokenizer=self.tokenizer,
            dynamic_sampling=algo.dynamic_sampling,
            max_tries=algo.max_dynamic_tries,
            overlong=overlong,
            reward_timeout_s=self.cfg.data.reward_timeout_s,
            return_routed_experts=algo.routing_replay == "R3",
        )

    def eval_prompts(self, n: int):
        if self.cfg.data.eval == "synthetic":
            return self.task.eval_prompts(n) if self.task is not None else _synthetic(self).eval_prompts(n)
        from megatron_rl.rollout.prompts import load_prompts

        if not self.cfg.data.eval:
            raise ValueError("data.eval is not set: no evaluation prompts")
        return load_prompts(
            self.cfg.data.eval,
            self.tokenizer,
            prompt_key=self.cfg.data.prompt_key,
            answer_key=self.cfg.data.answer_key,
            apply_chat_template=self.cfg.data.apply_chat_template,
        )[:n]

    def sft_pairs(self, n: int, *, start: int):
        if self.task is None:
            raise ValueError("warmup.sft_steps needs data.train: synthetic (no SFT data for other datasets yet)")
        return self.task.sft_pairs(n, start=start)

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


def _synthetic(data: PromptData):
    from megatron_rl.rollout.synthetic_task import SyntheticTask

    return SyntheticTask(seed=data.cfg.trainer.seed, tokenizer=data.tokenizer)
