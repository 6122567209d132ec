"""Evaluation metrics of one dataset, as RL papers report them: mean@k, pass@k, maj@k, greedy accuracy.

Pure functions of per-sample correctness (and, for maj@k, the extracted answers); no torch, no Megatron. A dataset
is a list of problems, each with ``n`` samples drawn i.i.d. from the policy:

* ``mean@n`` ("avg@n"): pass@1 averaged over the n samples of each problem, then over problems.
* ``pass@k``: the chance that at least one of k samples is correct, by the unbiased estimator of Chen et al. 2021,
  "Evaluating Large Language Models Trained on Code", eq. 1, over all n samples.
* ``maj@k``: the correctness of the majority answer among k samples (self-consistency, Wang et al. 2022).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``n`` samples of which ``c`` are correct (Chen et al. 2021, eq. 1).

    ``1 - C(n-c, k) / C(n, k)``, computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)`` (the paper's Figure 3), which
    never forms the large binomials. When ``n - c < k`` every k-subset holds a correct sample: 1.0.
    """
    if k < 1 or k > n or c < 0 or c > n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def _samples_per_problem(groups: Sequence[Sequence[object]], what: str) -> int:
    """The common length ``n`` of ``groups``; refuses no problems, empty problems and unequal lengths."""
    if len(groups) == 0:
        raise ValueError(f"{what} has no problems: pass at least one group of samples")
    lengths = sorted({len(group) for group in groups})
    if lengths[0] == 0:
        raise ValueError(f"{what} has a problem with no samples: every problem needs n >= 1 samples")
    if len(lengths) > 1:
        raise ValueError(f"{what} has problems with unequal sample counts {lengths}: give every problem n samples")
    return lengths[0]


def mean_pass_at_k(groups: Sequence[Sequence[bool]], k: int) -> float:
    """pass@k (Chen et al. 2021, eq. 1) averaged over problems; ``groups[p]`` is problem p's per-sample correctness."""
    if len(groups) == 0:
        raise ValueError("mean_pass_at_k has no problems: pass at least one group of samples")
    return math.fsum(pass_at_k(len(group), sum(1 for ok in group if ok), k) for group in groups) / len(groups)


def mean_at_k(groups: Sequence[Sequence[bool]]) -> float:
    """mean@k ("avg@k"): pass@1 averaged over the k samples of every problem, problems weighted equally.

    All groups must have the same length (then this is the plain mean of all correctness values).
    """
    n = _samples_per_problem(groups, "mean_at_k")
    return sum(1 for group in groups for ok in group if ok) / (n * len(groups))


def majority_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> float:
    """maj@k of ONE problem: the correctness of the most frequent answer among its first k samples.

    ``answers[i]`` is sample i's extracted answer (compared as given: the extractor normalises it), ``None`` when
    none was extracted; such a sample does not vote. The majority answer scores the mean correctness of the samples
    that gave it (equal for answer-based rewards). A tie between several answers with the top count scores the mean
    of their scores: the expected value of a uniform tie-break. No answer among the k samples: 0.0.
    """
    if len(answers) != len(correct):
        raise ValueError(
            f"majority_at_k got {len(answers)} answers but {len(correct)} correctness values: give one per sample"
        )
    if k < 1 or k > len(answers):
        raise ValueError(f"majority_at_k needs 1 <= k <= n, got k={k}, n={len(answers)}")
    votes: Counter[str] = Counter()
    n_correct: Counter[str] = Counter()
    for answer, ok in zip(answers[:k], correct[:k], strict=True):
        if answer is not None:
            votes[answer] += 1
            n_correct[answer] += 1 if ok else 0
    if not votes:
        return 0.0
    top = max(votes.values())
    tied = [answer for answer, count in votes.items() if count == top]
    return math.fsum(n_correct[answer] / top for answer in tied) / len(tied)


def mean_majority_at_k(
    answer_groups: Sequence[Sequence[str | None]], correct_groups: Sequence[Sequence[bool]], k: int
) -> float:
    """maj@k (see ``majority_at_k``) averaged over problems."""
    if len(answer_groups) != len(correct_groups):
        raise ValueError(
            f"mean_majority_at_k got {len(answer_groups)} answer groups but {len(correct_groups)} correctness "
            "groups: give one of each per problem"
        )
    if len(answer_groups) == 0:
        raise ValueError("mean_majority_at_k has no problems: pass at least one group of samples")
    scores = (majority_at_k(a, c, k) for a, c in zip(answer_groups, correct_groups, strict=True))
    return math.fsum(scores) / len(answer_groups)


def default_pass_k(n: int) -> tuple[int, ...]:
    """The default pass@k / maj@k values for n samples: the powers of 2 up to n, and n (6 -> (1, 2, 4, 6))."""
    if n < 1:
        raise ValueError(f"default_pass_k needs n >= 1 samples per problem, got n={n}")
    return tuple(sorted({2**e for e in range(n.bit_length()) if 2**e <= n} | {n}))


def dataset_metrics(
    groups_correct: Sequence[Sequence[bool]],
    *,
    pass_k: Sequence[int],
    answers: Sequence[Sequence[str | None]] | None = None,
    greedy: bool = False,
    response_lengths: Sequence[int] = (),
    truncated: Sequence[bool] = (),
) -> dict[str, float]:
    """The metrics of one dataset whose problems each have n samples; keys carry no prefix.

    ``groups_correct[p][i]`` is the correctness of sample i of problem p; ``answers`` (same shape) their extracted
    answers, ``response_lengths`` and ``truncated`` are per sample, problem-major (problem 0's n samples first).

    Keys: ``mean@{n}``; ``pass@{k}`` for each k of ``pass_k``, from all n samples by the unbiased estimator
    (Chen et al. 2021, eq. 1); ``maj@{k}`` for each k > 1 when ``answers`` is given, from the FIRST k samples of each
    problem (the samples are i.i.d., so those are one draw of k); ``accuracy`` when ``greedy`` (n must be 1: the
    share correct); ``response_length`` (mean tokens per sample) when ``response_lengths`` is given;
    ``truncation_rate`` (share of samples cut at the token limit) when ``truncated`` is given; ``problems`` and
    ``samples`` (counts).
    """
    n = _samples_per_problem(groups_correct, "dataset_metrics")
    for k in pass_k:
        if k > n:
            raise ValueError(f"pass_k has k={k} > n_samples={n}: lower pass_k or raise n_samples")
        if k < 1:
            raise ValueError(f"pass_k has k={k}: every k must be >= 1")
    n_samples = n * len(groups_correct)
    ks = sorted(set(pass_k))
    metrics: dict[str, float] = {f"mean@{n}": mean_at_k(groups_correct)}
    metrics.update({f"pass@{k}": mean_pass_at_k(groups_correct, k) for k in ks})
    if answers is not None:
        if len(answers) != len(groups_correct) or any(len(a) != n for a in answers):
            raise ValueError(
                f"answers must have the shape of groups_correct ({len(groups_correct)} problems x {n} samples)"
            )
        # maj@1 would be the first sample's accuracy alone: mean@n (= pass@1) says the same with all n samples.
        metrics.update({f"maj@{k}": mean_majority_at_k(answers, groups_correct, k) for k in ks if k > 1})
    if greedy:
        if n != 1:
            raise ValueError(f"greedy accuracy needs n_samples=1, got {n}: greedy samples of a prompt are identical")
        metrics["accuracy"] = metrics["mean@1"]
    for name, values in (("response_lengths", response_lengths), ("truncated", truncated)):
        if len(values) not in (0, n_samples):
            raise ValueError(f"{name} has {len(values)} values for {n_samples} samples: give one per sample or none")
    if response_lengths:
        metrics["response_length"] = math.fsum(response_lengths) / n_samples
    if truncated:
        metrics["truncation_rate"] = sum(1 for t in truncated if t) / n_samples
    metrics["problems"] = float(len(groups_correct))
    metrics["samples"] = float(n_samples)
    return metrics
