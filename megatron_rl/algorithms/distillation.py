"""On-policy distillation: the student samples, a teacher scores every sampled token, and the student lowers the
per-token reverse KL to the teacher (Agarwal et al., GKD, arXiv 2306.13649; Qwen3 Technical Report §4.5,
arXiv 2505.09388; Thinking Machines, "On-Policy Distillation", 2025).

At a sampled token ``y_t`` the reverse KL ``KL(π_θ ‖ π_T)`` has the one-sample estimate
``log π_θ(y_t | y_<t) − log π_T(y_t | y_<t)``; its negative, taken at the old policy θ_old that sampled, is a
per-token advantage:

    A_distill_t = log π_T(y_t) − log π_θold(y_t)                                          (1)

and a policy-gradient step on it lowers the reverse KL. Mixed with the task's (group-relative, per-sample)
advantage:

    A_t = [task_rewards] · A_task + coef · A_distill_t                                     (2)

Tokens outside the loss mask (prompts, multi-turn observations, padding) get 0.

Top-k distillation (``distill.top_k``; miles' top-k OPD) adds a loss term: at each position the teacher returns
its k most likely ids ``V_t`` and their log-probs; renormalised over ``V_t`` they give ``p̃_T``, and the term is the
forward KL of the student, taken at those ids, to it:

    L_topk_t = Σ_{v ∈ V_t} p̃_T(v) · (log p̃_T(v) − log π_θ(v | y_<t))                     (3)

with ``log π_θ`` the student's full log-softmax (not renormalised), so the gradient also moves the student's mass
from outside ``V_t`` into it; (3) is ≥ 0 and 0 only when the student puts all its mass on ``V_t`` in the teacher's
proportions.
"""

from __future__ import annotations

import torch


def reverse_kl_advantages(
    teacher_log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Eq. (1): ``[n, T]`` per-token advantages, 0 where ``mask`` is 0."""
    return torch.where(mask > 0, teacher_log_probs - old_log_probs, torch.zeros_like(old_log_probs))


def mixed_advantages(
    task: torch.Tensor, distill: torch.Tensor, mask: torch.Tensor, *, coef: float, task_rewards: bool = True
) -> torch.Tensor:
    """Eq. (2): ``task`` (``[n]`` per sample or ``[n, T]``) and ``distill`` (``[n, T]``) into ``[n, T]``
    per-token advantages, 0 where ``mask`` is 0."""
    per_token = task.view(-1, 1).expand_as(distill) if task.dim() == 1 else task
    mixed = coef * distill + (per_token if task_rewards else 0.0)
    return torch.where(mask > 0, mixed, torch.zeros_like(mixed))


def sequence_mean(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A sample's per-token advantages replaced by their mean over its masked tokens (what a sequence-level loss,
    GSPO, weighs its sequence ratio with); rows without a masked token get 0. Computed as the first masked
    token's value plus the mean deviation from it, so a sample whose advantage is one value keeps it bitwise."""
    valid = mask > 0
    count = valid.sum(-1, keepdim=True)
    first = advantages.gather(-1, valid.to(torch.int8).argmax(-1, keepdim=True))
    deviation = torch.where(valid, advantages - first, torch.zeros_like(advantages)).sum(-1, keepdim=True)
    mean = first + deviation / count.clamp_min(1)
    return torch.where(count > 0, mean, torch.zeros_like(mean)).expand_as(advantages)


def topk_kl(teacher_topk_log_probs: torch.Tensor, student_topk_log_probs: torch.Tensor) -> torch.Tensor:
    """Eq. (3): ``[n, T]`` from the teacher's top-k log-probs and the student's log-probs at the same ids
    (``[n, T, k]`` each)."""
    dtype = torch.promote_types(teacher_topk_log_probs.dtype, torch.float32)
    teacher = torch.log_softmax(teacher_topk_log_probs.to(dtype), dim=-1)  # renormalised over the k ids
    return (teacher.exp() * (teacher - student_topk_log_probs)).sum(-1)
