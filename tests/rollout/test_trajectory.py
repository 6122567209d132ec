"""Multi-turn trajectories: the loss mask covers exactly the generated tokens; limits cut like overlong responses."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_rl.rollout.agent.trajectory import TrajectoryBuilder, Turn


def test_hand_built_trajectory_masks_exactly_the_generated_tokens():
    b = TrajectoryBuilder([1, 2, 3], max_turns=4, max_tokens=100)
    b.add_turn([10, 11, 12], [-0.1, -0.2, -0.3], "v1", "stop")
    assert b.tokens == [1, 2, 3, 10, 11, 12]  # the next turn's prompt
    b.add_observation([20, 21])
    b.credit(0.5, {"tool_calls": 1})
    b.add_turn([13, 14], [-0.4, -0.5], "v2", "stop")
    b.add_observation([22])
    b.credit(0.25, {"tool_calls": 1, "tool_errors": 1})
    b.add_turn([15], [-0.6], "v2", "stop")
    t = b.build(done=True)

    assert t.tokens == [1, 2, 3, 10, 11, 12, 20, 21, 13, 14, 22, 15]
    assert t.response_start == 3
    assert t.response_ids == [10, 11, 12, 20, 21, 13, 14, 22, 15]
    assert t.loss_mask == [1, 1, 1, 0, 0, 1, 1, 0, 1]
    assert t.response_log_probs == [-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5, 0.0, -0.6]
    assert [tok for tok, m in zip(t.response_ids, t.loss_mask, strict=True) if m] == [10, 11, 12, 13, 14, 15]
    assert t.turns == (Turn(0, 3, "v1"), Turn(5, 7, "v2"), Turn(8, 9, "v2"))
    assert t.weight_versions == ["v1", "v2", "v2"]
    assert t.finish_reason == "stop"
    assert t.reward == 0.75
    assert t.metrics == {"tool_calls": 2.0, "tool_errors": 1.0}


def test_max_turns_ends_with_length():
    b = TrajectoryBuilder([1], max_turns=2, max_tokens=100)
    b.add_turn([5], [-1.0], "v0", "stop")
    b.add_observation([6])
    assert b.can_generate
    b.add_turn([7], [-1.0], "v0", "stop")
    assert not b.can_generate
    with pytest.raises(ValueError, match="max_turns"):
        b.add_turn([8], [-1.0], "v0", "stop")
    assert b.build(done=False).finish_reason == "length"  # the environment wanted more turns
    assert b.build(done=True).finish_reason == "stop"


def test_token_limit_cuts_a_turn_and_ends_with_length():
    b = TrajectoryBuilder([1, 2], max_tokens=7, max_turns=5)
    b.add_turn([3, 4], [-0.1, -0.2], "v0", "stop")
    b.add_observation([5])
    assert b.remaining_tokens == 2
    b.add_turn([6, 7, 8, 9], [-0.3, -0.4, -0.5, -0.6], "v0", "stop")
    t = b.build(done=True)  # even a done environment cannot undo the cut
    assert t.tokens == [1, 2, 3, 4, 5, 6, 7]
    assert t.loss_mask == [1, 1, 0, 1, 1]
    assert t.response_log_probs == [-0.1, -0.2, 0.0, -0.3, -0.4]
    assert t.turns[-1] == Turn(3, 5, "v0")
    assert t.finish_reason == "length"
    assert not b.can_generate


def test_token_limit_cuts_an_observation():
    b = TrajectoryBuilder([1], max_tokens=5, max_turns=5)
    b.add_turn([2, 3], [-0.1, -0.2], "v0", "stop")
    b.add_observation([4, 5, 6, 7])
    t = b.build(done=False)
    assert t.response_ids == [2, 3] and t.loss_mask == [1, 1]  # an observation after the last turn trains nothing
    assert t.finish_reason == "length"
    with pytest.raises(ValueError, match="already ended"):
        b.add_observation([8])


def test_a_turn_cut_by_the_engine_ends_the_trajectory_with_its_reason():
    for reason in ("length", "abort"):
        b = TrajectoryBuilder([1], max_tokens=50, max_turns=5)
        b.add_turn([2, 3], [-0.1, -0.2], "v0", reason)
        assert not b.can_generate
        assert b.build(done=False).finish_reason == reason


def test_refusals():
    with pytest.raises(ValueError, match="max_turns must be at least 1"):
        TrajectoryBuilder([1], max_turns=0, max_tokens=10)
    with pytest.raises(ValueError, match="the prompt has 3 tokens, max_tokens is 3"):
        TrajectoryBuilder([1, 2, 3], max_turns=1, max_tokens=3)
    b = TrajectoryBuilder([1], max_turns=1, max_tokens=10)
    with pytest.raises(ValueError, match="2 log-probs for 1 generated tokens"):
        b.add_turn([2], [-0.1, -0.2], "v0", "stop")
    with pytest.raises(ValueError, match="at least one generated turn"):
        b.build(done=True)


def test_routes_are_the_last_turns_cut_to_the_final_sequence():
    def routes(first: int, n: int) -> np.ndarray:  # position p routed to experts (p, p + 100)
        return np.stack([np.arange(first, first + n), np.arange(first, first + n) + 100], -1)[:, None, :]

    b = TrajectoryBuilder([1, 2], max_turns=3, max_tokens=9)
    b.add_turn([3, 4], [-0.1, -0.2], "v0", "stop", routes(0, 3))  # fed positions 0..2 (prompt + first token)
    b.add_observation([5])
    with pytest.raises(ValueError, match="routes of 5 positions for a turn that fed 6"):
        b.add_turn([6, 7], [-0.3, -0.4], "v0", "stop", routes(0, 5))
    b.add_turn([6, 7, 8, 9, 10], [-0.3, -0.4, -0.5, -0.6, -0.7], "v0", "stop", routes(0, 9))  # cut at 9 tokens
    t = b.build(done=True)
    assert t.tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9] and t.finish_reason == "length"
    assert t.routed_experts is not None
    np.testing.assert_array_equal(t.routed_experts, routes(0, 8))  # one row per fed position of the final sequence
