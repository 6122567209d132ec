"""A distillation teacher served by an engine (`algo.distill.served_by: local_engine` or `sglang`): it scores the
tokens of each rollout batch as the batch is collected, beside the rewards, so the log-probs travel with their
samples."""

from __future__ import annotations

from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.sample import Sample


def add_teacher_log_probs(teacher: RolloutEngine, samples: list[Sample], top_k: int = 0) -> None:
    """Set every sample's `teacher_log_probs`: the teacher's teacher-forced log-probs (temperature 1) of its tokens
    after the first (with `top_k`, also `teacher_topk_ids` / `teacher_topk_log_probs`: its `top_k` likeliest tokens
    at each of those positions), from one `score_prompts` call (a prefill of the whole batch, no sampling)."""
    if not samples:
        return
    served = teacher.score_prompts([s.tokens for s in samples], top_k=top_k)[0]
    top_ids, top_logp = served.top_ids, served.top_log_probs
    if top_k and (top_ids is None or top_logp is None):
        raise RuntimeError(f"the teacher ({served.replica}) returned no top-{top_k} log-probs")
    for i, (sample, log_probs) in enumerate(zip(samples, served.log_probs, strict=True)):
        scored = [len(log_probs)]
        if top_ids is not None and top_logp is not None:
            scored += [len(top_ids[i]), len(top_logp[i])]
            if any(len(row) != top_k for row in top_ids[i]):
                raise RuntimeError(f"the teacher ({served.replica}) returned fewer than {top_k} top log-probs")
        if any(n != len(sample.tokens) - 1 for n in scored):
            raise RuntimeError(
                f"the teacher ({served.replica}) scored {min(scored)} tokens of a {len(sample.tokens)}-token sample"
            )
        sample.teacher_log_probs = log_probs
        if top_ids is not None and top_logp is not None:
            sample.teacher_topk_ids, sample.teacher_topk_log_probs = top_ids[i], top_logp[i]
