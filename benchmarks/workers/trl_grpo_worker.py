"""Worker of bench_vs_trl.py: the demo's GSPO run with TRL's `GRPOTrainer`, timed per phase.

Runs under an interpreter that has TRL (``--trl-python`` of the benchmark) with this repository on PYTHONPATH, so
the prompts (`SyntheticTask`, the same seed and order as our trainer draws them) and the reward (our registry)
are the very objects our trainer uses. Settings mirror examples/tiny_moe_gspo.yaml: P prompts x G samples per
generation, 16 new tokens at temperature 1, GSPO (sequence-level ratio, clip 3e-4/4e-4, per-sequence token mean =
TRL's ``loss_type="grpo"``), group-std advantages, no KL, AdamW at a constant LR with grad-norm clip 1, fp32, no
activation checkpointing (TRL's default turns it on; ours does not recompute), and two optimizer updates per
generation (``steps_per_generation=2``, which makes TRL compute the old-policy log-probs).
One of our RL steps is therefore two TRL optimizer steps.

Phases are timed by wrapping the trainer's own methods on the instance (no change to TRL's code):
``_generate_and_score_completions`` (generation, rewards, advantages, and inside it the old-policy pass),
``_get_per_token_logps_and_entropies`` while inside it (the old-log-prob pass), and a callback's ``on_step_end``
at the second optimizer step of each generation (the end of the RL step). Rollout = generate-and-score minus the
old-log-prob pass (as our `time/rollout` it includes rewards); updates = step minus generate-and-score.

Each generation also reports its prompt and generated token counts (the benchmark's FLOP anchor). Greedy
accuracy on the held-out prompts is measured before and after with ``model.generate`` (exact reversed
digits ended by EOS, scored by the same reward function). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any

import torch


class PhaseTimer:
    """Per-RL-step seconds of TRL's phases, from wrappers around the trainer's methods."""

    def __init__(self, trainer: Any, updates_per_step: int) -> None:
        self.updates_per_step = updates_per_step
        self.steps: list[dict[str, float]] = []
        self._inside = False
        self._current: dict[str, float] = {}
        score, logps = trainer._generate_and_score_completions, trainer._get_per_token_logps_and_entropies

        def timed_score(inputs: Any) -> Any:
            self._current = {"start": time.perf_counter(), "old_logp": 0.0}
            self._inside = True
            try:
                return score(inputs)
            finally:
                self._inside = False
                self._current["generate_and_score"] = time.perf_counter() - self._current["start"]

        def timed_logps(*args: Any, **kwargs: Any) -> Any:
            if not self._inside:
                return logps(*args, **kwargs)
            t = time.perf_counter()
            try:
                return logps(*args, **kwargs)
            finally:
                self._current["old_logp"] += time.perf_counter() - t

        trainer._generate_and_score_completions = timed_score
        trainer._get_per_token_logps_and_entropies = timed_logps

    def step_end(self, global_step: int) -> None:
        if global_step % self.updates_per_step:
            return
        c = self._current
        step = time.perf_counter() - c["start"]
        self.steps.append(
            {
                "rollout": c["generate_and_score"] - c["old_logp"],
                "old_logp": c["old_logp"],
                "train": step - c["generate_and_score"],
                "sync": 0.0,  # TRL generates with the training model itself: no weight sync
                "step": step,
            }
        )


def greedy_accuracy(model: Any, tokenizer: Any, prompts: list, reward_fn: Any, max_new_tokens: int) -> float:
    """Share of `prompts` whose greedy answer earns reward 1 (batched, left-padded)."""
    from megatron_rl.rollout.sample import Sample

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    width = max(len(p.token_ids) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p.token_ids)) + list(p.token_ids) for p in prompts])
    mask = (torch.arange(width) >= width - torch.tensor([len(p.token_ids) for p in prompts])[:, None]).long()
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
        )
    model.train(was_training)
    right = 0
    for p, row in zip(prompts, out[:, width:].tolist(), strict=True):
        stopped = eos in row
        response = row[: row.index(eos) + 1] if stopped else row
        sample = Sample(list(p.token_ids), response, [0.0] * len(response), "stop" if stopped else "length", "eval")
        text = tokenizer.decode(response, skip_special_tokens=True)
        right += reward_fn(sample, text, {"answer": p.answer}) > 0.5
    return right / len(prompts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="HF model directory (the warmed-up demo model)")
    parser.add_argument("--steps", type=int, default=10, help="RL steps (each = --updates optimizer steps)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--updates", type=int, default=2, help="optimizer updates per generation")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--clip-low", type=float, default=3e-4)
    parser.add_argument("--clip-high", type=float, default=4e-4)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--reward", default="synthetic", help="name in megatron_rl.rollout.rewards")
    parser.add_argument("--eval-prompts", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from megatron_rl.rollout.rewards import get_reward
    from megatron_rl.rollout.sample import Sample
    from megatron_rl.rollout.tasks.synthetic_task import SyntheticTask

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    task = SyntheticTask(seed=args.seed, tokenizer=tokenizer)
    reward_fn, eos = get_reward(args.reward), tokenizer.eos_token_id
    rewards: list[float] = []
    generated: list[int] = []
    prompt_tokens: list[int] = []  # per generation, as `generated`: the FLOP count of the benchmark's anchor

    def reward(prompts: list, completions: list, completion_ids: list, answer: list, **_: Any) -> list[float]:
        out = []
        for text, ids, ans in zip(completions, completion_ids, answer, strict=True):
            sample = Sample([], list(ids), [0.0] * len(ids), "stop" if ids and ids[-1] == eos else "length", "trl")
            out.append(reward_fn(sample, text, {"answer": ans}))
        rewards.append(sum(out) / len(out))
        generated.append(sum(len(ids) for ids in completion_ids))
        prompt_tokens.append(sum(len(tokenizer(p).input_ids) for p in prompts))
        return out

    reward.__name__ = args.reward
    # Our trainer draws training prompts 0, 1, 2, ... of the seed's stream; no shuffle keeps that order here.
    stream = task.prompts(args.steps * args.prompts)
    dataset = Dataset.from_list([{"prompt": p.text, "answer": p.answer} for p in stream])
    eval_prompts = task.eval_prompts(args.eval_prompts)
    before = greedy_accuracy(model, tokenizer, eval_prompts, reward_fn, args.max_new_tokens)

    batch = args.prompts * args.samples
    with tempfile.TemporaryDirectory() as out_dir:
        config = trl.GRPOConfig(
            output_dir=out_dir,
            per_device_train_batch_size=batch // args.updates,
            gradient_accumulation_steps=1,
            steps_per_generation=args.updates,
            num_generations=args.samples,
            num_iterations=1,
            max_completion_length=args.max_new_tokens,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            adam_beta1=0.9,
            adam_beta2=0.999,
            adam_epsilon=1e-8,
            max_grad_norm=1.0,
            gradient_checkpointing=False,  # TRL's default recomputes activations; ours does not
            beta=0.0,
            epsilon=args.clip_low,
            epsilon_high=args.clip_high,
            importance_sampling_level="sequence",
            loss_type="grpo",
            scale_rewards="group",
            shuffle_dataset=False,
            max_steps=args.steps * args.updates,
            use_cpu=True,
            bf16=False,
            fp16=False,
            seed=args.seed,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = trl.GRPOTrainer(
            model=model, reward_funcs=[reward], args=config, train_dataset=dataset, processing_class=tokenizer
        )
        timer = PhaseTimer(trainer, args.updates)

        class StepEnd(TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                timer.step_end(state.global_step)

        trainer.add_callback(StepEnd())
        trainer.train()
    after = greedy_accuracy(trainer.model, tokenizer, eval_prompts, reward_fn, args.max_new_tokens)
    result = {
        "trl": trl.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "steps": timer.steps,
        "generated_tokens": generated,
        "prompt_tokens": prompt_tokens,
        "reward_mean": rewards,
        "eval_accuracy": {"before": before, "after": after},
    }
    print("TRL_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
