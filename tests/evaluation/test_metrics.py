"""Evaluation metrics against hand computations and a brute-force pass@k over all k-subsets."""

from __future__ import annotations

import itertools
import math

import pytest

from megatron_rl.evaluation.metrics import (
    dataset_metrics,
    default_pass_k,
    majority_at_k,
    mean_at_k,
    mean_majority_at_k,
    mean_pass_at_k,
    pass_at_k,
)

T, F = True, False


def test_pass_at_k_hand_values():
    # n = k: pass@n is 1 as soon as one sample is correct, 0 only when none is.
    assert pass_at_k(4, 4, 4) == 1.0
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 0, 4) == 0.0
    # All correct, none correct.
    assert pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(5, 0, 1) == 0.0
    assert pass_at_k(5, 0, 3) == 0.0
    # One correct of four: a k-subset holds it with chance k/4.
    for k, expected in [(1, 0.25), (2, 0.5), (3, 0.75), (4, 1.0)]:
        assert pass_at_k(4, 1, k) == pytest.approx(expected, abs=1e-15)
    # Two correct of five at k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10.
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=1e-15)
    # pass@1 is c/n.
    assert pass_at_k(7, 3, 1) == pytest.approx(3 / 7, abs=1e-15)


def test_pass_at_k_against_all_k_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            correct = [i < c for i in range(n)]
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                brute = sum(any(correct[i] for i in s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)
                assert brute == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_is_stable_for_large_n():
    # C(1000, 500) overflows a float; the product form does not: 1 - C(990,500)/C(1000,500) = 1 - prod (1 - 500/i).
    exact = 1 - math.comb(990, 500) / math.comb(1000, 500)  # exact integer division in Python
    assert pass_at_k(1000, 10, 500) == pytest.approx(exact, rel=1e-12)


@pytest.mark.parametrize("n,c,k", [(4, 1, 0), (4, 1, 5), (4, -1, 2), (4, 5, 2)])
def test_pass_at_k_refuses_bad_values(n, c, k):
    with pytest.raises(ValueError, match=f"n={n}, c={c}, k={k}"):
        pass_at_k(n, c, k)


def test_mean_pass_at_k_and_mean_at_k():
    groups = [[T, F, F, F], [T, T, F, F], [F, F, F, F]]
    # pass@2: 1/2, 1 - C(2,2)/C(4,2) = 5/6, 0.
    assert mean_pass_at_k(groups, 2) == pytest.approx((0.5 + 5 / 6 + 0.0) / 3, abs=1e-15)
    assert mean_pass_at_k(groups, 1) == pytest.approx(3 / 12, abs=1e-15)
    assert mean_at_k(groups) == pytest.approx(3 / 12, abs=1e-15)
    assert mean_at_k([[T, T], [F, T]]) == 0.75


def test_unequal_groups_and_no_problems_are_refused():
    with pytest.raises(ValueError, match="unequal sample counts"):
        mean_at_k([[T, F], [T]])
    with pytest.raises(ValueError, match="unequal sample counts"):
        dataset_metrics([[T, F], [T]], pass_k=[1])
    with pytest.raises(ValueError, match="no problems"):
        mean_at_k([])
    with pytest.raises(ValueError, match="no problems"):
        mean_pass_at_k([], 1)
    with pytest.raises(ValueError, match="no samples"):
        mean_at_k([[]])


def test_majority_at_k_ties():
    answers, correct = ["3", "4", "3", "4"], [T, F, T, F]
    # k=4: '3' and '4' tie at two votes each; a uniform tie-break is right half the time.
    assert majority_at_k(answers, correct, 4) == 0.5
    # k=3: '3' has two votes of three.
    assert majority_at_k(answers, correct, 3) == 1.0
    # k=2: a tie again; k=1: '3' alone.
    assert majority_at_k(answers, correct, 2) == 0.5
    assert majority_at_k(answers, correct, 1) == 1.0
    # A three-way tie with one correct answer: 1/3.
    assert majority_at_k(["x", "y", "z"], [F, T, F], 3) == pytest.approx(1 / 3, abs=1e-15)


def test_majority_at_k_none_answers_do_not_vote():
    answers, correct = [None, "5", None, "7", "7"], [F, F, F, T, T]
    assert majority_at_k(answers, correct, 5) == 1.0  # '7' (2 votes) beats '5' (1)
    assert majority_at_k(answers, correct, 3) == 0.0  # only '5' votes
    assert majority_at_k(answers, correct, 1) == 0.0  # nobody votes
    assert majority_at_k([None, None, None], [F, T, F], 3) == 0.0
    # Three Nones outnumber nothing: '2' wins with a single vote.
    assert majority_at_k([None, None, None, "2"], [F, F, F, T], 4) == 1.0


def test_majority_answer_with_mixed_correctness_scores_its_mean():
    # A reward that is not a function of the answer: 'a' is right once in two.
    assert majority_at_k(["a", "a", "b"], [T, F, T], 3) == 0.5
    # Tie between 'a' (mean 1/2) and 'b' (mean 1): (1/2 + 1) / 2.
    assert majority_at_k(["a", "a", "b", "b"], [T, F, T, T], 4) == 0.75


def test_majority_at_k_refuses_bad_input():
    with pytest.raises(ValueError, match="2 answers but 3 correctness"):
        majority_at_k(["1", "2"], [T, F, T], 1)
    with pytest.raises(ValueError, match="k=3, n=2"):
        majority_at_k(["1", "2"], [T, F], 3)
    with pytest.raises(ValueError, match="1 answer groups but 2"):
        mean_majority_at_k([["1"]], [[T], [F]], 1)


def test_mean_majority_at_k():
    answers = [["3", "4", "3", "4"], ["1", "1", None, "2"], [None, None, None, None]]
    correct = [[T, F, T, F], [F, F, F, T], [T, F, F, F]]
    assert mean_majority_at_k(answers, correct, 4) == pytest.approx((0.5 + 0.0 + 0.0) / 3, abs=1e-15)
    assert mean_majority_at_k(answers, correct, 1) == pytest.approx((1.0 + 0.0 + 0.0) / 3, abs=1e-15)


def test_default_pass_k():
    assert default_pass_k(1) == (1,)
    assert default_pass_k(2) == (1, 2)
    assert default_pass_k(6) == (1, 2, 4, 6)
    assert default_pass_k(8) == (1, 2, 4, 8)
    assert default_pass_k(32) == (1, 2, 4, 8, 16, 32)
    assert default_pass_k(33) == (1, 2, 4, 8, 16, 32, 33)
    with pytest.raises(ValueError, match="n=0"):
        default_pass_k(0)


def test_dataset_metrics_values_and_keys():
    correct = [[T, F, F, F], [T, T, F, F]]
    answers = [["1", "2", "2", "3"], ["5", "5", "6", None]]
    metrics = dataset_metrics(
        correct,
        pass_k=[4, 1, 2],
        answers=answers,
        response_lengths=[10, 20, 30, 40, 5, 5, 5, 5],
        truncated=[F, F, F, T, F, F, T, T],
    )
    expected = {
        "mean@4": 3 / 8,
        "pass@1": 3 / 8,
        "pass@2": (0.5 + 5 / 6) / 2,  # 1/2 and 1 - C(2,2)/C(4,2)
        "pass@4": 1.0,
        # maj@2: '1'/'2' tie (1/2), '5'. maj@4: '2' wrong, '5' right. (No maj@1: one sample's accuracy.)
        "maj@2": 0.75,
        "maj@4": 0.5,
        "response_length": 15.0,
        "truncation_rate": 3 / 8,
        "problems": 2.0,
        "samples": 8.0,
    }
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=1e-15), key


def test_dataset_metrics_greedy_and_minimal_keys():
    metrics = dataset_metrics([[T], [F], [T], [T]], pass_k=default_pass_k(1), greedy=True)
    assert metrics == {"mean@1": 0.75, "pass@1": 0.75, "accuracy": 0.75, "problems": 4.0, "samples": 4.0}
    assert set(dataset_metrics([[T, F]], pass_k=[2])) == {"mean@2", "pass@2", "problems", "samples"}


def test_dataset_metrics_refusals():
    correct = [[T, F, F, F], [T, T, F, F]]
    with pytest.raises(ValueError, match="k=8 > n_samples=4: lower pass_k or raise n_samples"):
        dataset_metrics(correct, pass_k=[1, 8])
    with pytest.raises(ValueError, match="k=0"):
        dataset_metrics(correct, pass_k=[0])
    with pytest.raises(ValueError, match="greedy accuracy needs n_samples=1, got 4"):
        dataset_metrics(correct, pass_k=[1], greedy=True)
    with pytest.raises(ValueError, match="answers must have the shape"):
        dataset_metrics(correct, pass_k=[1], answers=[["1", "2", "3", "4"]])
    with pytest.raises(ValueError, match="response_lengths has 3 values for 8 samples"):
        dataset_metrics(correct, pass_k=[1], response_lengths=[1, 2, 3])
    with pytest.raises(ValueError, match="truncated has 1 values for 8 samples"):
        dataset_metrics(correct, pass_k=[1], truncated=[T])
