"""A distillation teacher served by an engine (`algo.distill.served_by: local_engine`): it scores the tokens of each
rollout batch as the batch is collected, beside the rewards, so the log-probs travel with their samples."""

from __future__ import annotations

from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.sample import Sample


def add_teacher_log_probs(teacher: RolloutEngine, samples: list[Sample]) -> None:
    """Set every sample's `teacher_log_probs`: the teacher's teacher-forced log-probs (temperature 1) of its tokens
    after the first, from one `score_prompts` call (a prefill of the whole batch, no sampling)."""
    if not samples:
        return
    served = teacher.score_prompts([s.tokens for s in samples])[0]
    for sample, log_probs in zip(samples, served.log_probs, strict=True):
        if len(log_probs) != len(sample.tokens) - 1:
            raise RuntimeError(
                f"the teacher ({served.replica}) scored {len(log_probs)} tokens of a {len(sample.tokens)}-token sample"
            )
        sample.teacher_log_probs = log_probs
