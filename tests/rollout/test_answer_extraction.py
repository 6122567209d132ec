"""`extract_answer`: the canonical final answer each built-in reward exposes for maj@k, and `RewardSet`'s choice
of the extractor, its keywords and its errors."""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from typing import Any

import pytest

from megatron_rl.config.schema import RewardSpec
from megatron_rl.rollout.rewards import REWARD_FUNCTIONS, RewardSet, get_reward
from megatron_rl.rollout.sample import Sample


def _sample(answer: str = "", finish_reason: str = "stop", **metadata: Any) -> Sample:
    return Sample([1, 2], [3], [-0.1], finish_reason, "v0", metadata={"answer": answer, **metadata})


def _extract(name: str, text: str, **keywords: Any) -> str | None:
    return get_reward(name).extract_answer(text, **keywords)


# ---------------------------------------------------------------------------------------------- built-ins
GSM8K_SOLUTION = "She sells 16 - 3 - 4 = 9 eggs for $2 each, 9 * 2 = 18.\n#### 18"


def test_gsm8k_extracts_the_hash_answer_as_a_canonical_number() -> None:
    assert _extract("gsm8k", "Natalia sold 48 + 24 = 72 clips.\n#### 1,000") == "1000"
    assert _extract("gsm8k", "#### $1000") == "1000"
    assert _extract("gsm8k", "So the total is 1000.0") == "1000"  # no ####: the last number
    assert _extract("gsm8k", "#### 72.50") == "72.5"
    assert _extract("gsm8k", "#### -0.0") == "0"
    assert _extract("gsm8k", "It is 1 of 3 eggs, #### 3") == "3"  # the hash answer, not the last number before it
    assert _extract("gsm8k", "I do not know.") is None


def test_gsm8k_canonical_forms_vote_together_and_score_alike() -> None:
    reward = get_reward("gsm8k")
    texts = ["#### 1,000", "#### 1000", "#### $1000", "The answer is 1000.0", "#### 1000.00"]
    assert {reward.extract_answer(t) for t in texts} == {"1000"}
    assert [reward(_sample("#### 1,000"), t, {"answer": "#### 1,000"}) for t in texts] == [1.0] * 5
    assert reward.extract_answer("#### 1001") != "1000"


def test_math_and_its_alias_extract_the_last_boxed_answer_lightly_normalised() -> None:
    assert get_reward("math_verify").extract_answer is get_reward("math").extract_answer
    assert _extract("math", "First \\boxed{3}, then $x = \\boxed{\\frac{1}{2}}$.") == "\\frac{1}{2}"
    assert _extract("math", "\\boxed{\\dfrac {1}{2}.}") == "\\frac{1}{2}"
    assert _extract("math", "\\boxed{\\left( 1, \\!2 \\right)}") == "(1,2)"
    assert _extract("math", "\\boxed{x \\leftarrow y}") == "x\\leftarrowy"  # \leftarrow is not \left
    assert _extract("math", "\\boxed{\\sqrt{\\frac{1}{4}}}") == "\\sqrt{\\frac{1}{4}}"  # nested braces kept
    # equal by math-verify, written differently: they vote apart (documented)
    assert _extract("math", "\\boxed{0.5}") != _extract("math", "\\boxed{\\frac{1}{2}}")
    assert _extract("math", "The answer is 1/2.") is None
    assert _extract("math", "\\boxed{ }") is None


def test_dapo_extracts_the_answer_line_with_the_minerva_normaliser() -> None:
    assert _extract("dapo", "Let me compute 3 * 4.\nAnswer: 12") == "12"
    assert _extract("dapo", "Answer: 5\nrechecking...\nAnswer: $12$ dollars") == "12"  # the last line
    assert _extract("dapo", "Answer: \\frac12") == "\\frac{1}{2}"
    assert _extract("dapo", "Answer: 1,000") == "1000"
    assert _extract("dapo", "Answer: 7" + "." * 300) is None  # outside the last 300 characters, as the reward
    assert _extract("dapo", "The result is 12.") is None


def test_math_answer_votes_numbers_by_value_and_other_answers_as_normalised_strings() -> None:
    keys = {_extract("math_answer", t) for t in ("\\boxed{\\frac{1}{2}}", "The answer is 1/2.", "so 0.5")}
    assert keys == {"0.5"}
    assert _extract("math_answer", "The answer is 1,000.") == "1000"
    assert _extract("math_answer", "\\boxed{\\text{Monday}}") == _extract("math_answer", "Answer: monday") == "monday"
    assert _extract("math_answer", "no numbers here") is None


def test_auto_routes_the_extractor_by_the_samples_data_source() -> None:
    assert _extract("auto", "#### 1,000", sample=_sample(data_source="openai/gsm8k")) == "1000"
    assert _extract("auto", "\\boxed{\\dfrac12}", sample=_sample(data_source="HuggingFaceH4/MATH-500")) == "\\frac12"
    assert _extract("auto", "Answer: 1,000", sample=_sample(data_source="aime_2025")) == "1000"
    with pytest.raises(ValueError, match="pass sample="):
        _extract("auto", "#### 3")
    with pytest.raises(ValueError, match="data_source 'my/data' is not in its table"):
        _extract("auto", "#### 3", sample=_sample(data_source="my/data"))


def test_exact_match_and_the_synthetic_tasks_extract_the_stripped_answer() -> None:
    assert _extract("exact_match", "  Paris \n") == "Paris"
    assert _extract("synthetic", "1284 ") == "1284"  # registered by dotted path: loaded with its attribute
    assert _extract("synthetic", "  ") is None
    tool_text = "[calculator:37*58]\n=2146\n2146"
    assert _extract("synthetic_tool", tool_text) == "2146"  # no sample: the response's last line
    turns = _sample(turn_texts=["[calculator:37*58]<|im_end|>", "2146<|im_end|>"])
    assert _extract("synthetic_tool", "ignored", sample=turns) == "2146"  # the final turn, special tokens removed
    assert _extract("synthetic_tool", "[calculator:37*58]\n=2146\n") is None


# ---------------------------------------------------------------------------------------------- RewardSet
def length_bonus(sample: Sample, text: str, metadata: Mapping[str, Any]) -> float:
    return 0.01 * len(text)


def user_reward(sample: Sample, text: str, metadata: Mapping[str, Any]) -> float:
    return float(text.split()[-1] == metadata["answer"])


user_reward.extract_answer = lambda text: text.split()[-1].upper() if text.split() else None


def trl_reward(prompts: list, completions: list, answer: list, **kwargs: Any) -> list[float]:
    return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]


def _trl_answer(text: str, *, sample: Sample | None = None, prefix: str = "") -> str:
    group = sample.group_index if sample is not None else -1
    return f"{prefix}{text.strip()}@{group}"


trl_reward.extract_answer = _trl_answer


def failing_reward(sample: Sample, text: str, metadata: Mapping[str, Any]) -> float:
    return 0.0


def _raises(text: str) -> str:
    raise RuntimeError("no boxed\nanswer")


failing_reward.extract_answer = _raises


def test_a_weighted_list_uses_the_first_part_with_an_extractor() -> None:
    reward = RewardSet.from_specs(
        [length_bonus, RewardSpec("gsm8k", 0.5, {"strict": True}), RewardSpec("math", 1.0), user_reward]
    )
    assert reward.extracts_answers
    # gsm8k decides (length_bonus has none), with its option strict=True: no `####`, no answer
    assert reward.extract_answer(_sample(), "#### 2,500 \\boxed{7}") == "2500"
    assert reward.extract_answer(_sample(), "It is 2500. \\boxed{7}") is None
    lenient = RewardSet.from_specs([RewardSpec("math", 1.0), RewardSpec("gsm8k", 0.5)])
    assert lenient.extract_answer(_sample(), "#### 2,500 \\boxed{7}") == "7"


def test_no_part_with_an_extractor_means_no_answers() -> None:
    reward = RewardSet.from_specs([length_bonus])
    assert not reward.extracts_answers
    assert reward.extract_answer(_sample(), "#### 3") is None


def test_user_functions_set_the_attribute_per_sample_and_trl_style() -> None:
    mine = RewardSet.from_specs([user_reward])
    assert mine.extract_answer(_sample(), "it is paris") == "PARIS"
    assert mine.extract_answer(_sample(), "") is None
    sample = _sample()
    sample.group_index = 7
    trl = RewardSet.from_specs([trl_reward])  # batched TRL style; its extractor names sample= and gets it
    assert trl.extract_answer(sample, " 42 ") == "42@7"
    by_path = RewardSet.from_specs([RewardSpec(f"{__name__}:trl_reward", 1.0, {"prefix": "p:"})])
    assert by_path.extract_answer(sample, " 42 ") == "p:42@7"  # loaded by import path; the option it names


def test_a_raising_extractor_is_a_value_error_naming_the_reward() -> None:
    reward = RewardSet.from_specs([failing_reward])
    message = f"reward '{__name__}:failing_reward': extract_answer raised RuntimeError: no boxed answer"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):  # one line, the reward named
        reward.extract_answer(_sample(), "anything")


def test_an_extractor_returning_a_non_string_or_of_the_wrong_shape_is_refused() -> None:
    def returns_number(sample: Sample, text: str, metadata: Mapping[str, Any]) -> float:
        return 0.0

    returns_number.extract_answer = lambda text: 42
    with pytest.raises(ValueError, match=r"extract_answer returned '42' \(int\); return the answer as a str"):
        RewardSet.from_specs([returns_number]).extract_answer(_sample(), "x")

    returns_number.extract_answer = lambda text, metadata: "x"
    with pytest.raises(ValueError, match=r"cannot be called as extract_answer\(text\)"):
        RewardSet.from_specs([returns_number])
    returns_number.extract_answer = "12"
    with pytest.raises(ValueError, match="its extract_answer is a str; set it to a function"):
        RewardSet.from_specs([returns_number])


def test_the_rewards_listing_marks_the_rewards_with_an_extractor(capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_rl.commands.rewards import run

    assert run(argparse.Namespace(plugin=[])) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["name", "where", "it", "runs", "maj@k"]
    column = lines[0].index("maj@k")
    marks = {line.split()[0]: line[column : column + 5].strip() for line in lines[1 : lines.index("")]}
    assert set(marks) == set(REWARD_FUNCTIONS)
    assert marks.pop("remote") == "no"  # the service's answer format is its own: nothing to vote on here
    assert marks.pop("judge") == "no"  # so is the judge's
    assert set(marks.values()) == {"yes"}
