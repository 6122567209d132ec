"""The built-in rewards on real answer formats, with the verdicts a person gives; `auto`'s routing and refusals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from megatron_rl.config.loader import load_config
from megatron_rl.optional_deps import MissingOptionalDependency
from megatron_rl.rollout.data import PromptData
from megatron_rl.rollout.rewards import (
    RewardSet,
    auto,
    check_auto_sources,
    dapo,
    get_reward,
    gsm8k,
    math_answer,
    math_reward,
)
from megatron_rl.rollout.sample import Sample

# A GSM8K training row's reference: the worked solution, ending in the `#### N` line.
NATALIA = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)
# A MATH row's reference: a solution with the answer boxed inside $...$.
MATH_SOLUTION = "There are 4 equally likely outcomes, one of them good, so the probability is $\\boxed{\\frac{1}{4}}$."


def _score(fn, text: str, answer: str, **metadata) -> float:
    sample = Sample([5], [6], [0.0], "stop", "v0", metadata={"answer": answer, **metadata})
    return fn(sample, text, sample.metadata)


@pytest.mark.parametrize(
    "text,answer,expected",
    [
        ("She sold 24 in May, 48 + 24 = 72 in total.\n#### 72", NATALIA, 1.0),  # the whole solution as reference
        ("48 + 24 = 73\n#### 73", NATALIA, 0.0),
        ("#### 1,000", "1000", 1.0),  # commas
        ("#### 1000", "1,000", 1.0),
        ("#### 72.00", "72", 1.0),  # trailing zeros
        ("#### $18", "18", 1.0),
        ("#### -3", "-3", 1.0),
        ("The answer is 7", "7", 1.0),  # flexible: the last number
        ("The answer is 7.", "x = 3 + 4\n#### 7", 1.0),
        ("\\boxed{7}", "7", 1.0),
        ("She makes $18 every day.", "#### 18", 1.0),
        ("#### 7, or maybe 8", "7", 1.0),  # the #### answer wins over a later number
        ("we get 12 apples, then 13", "12", 0.0),  # the last number, not an earlier one
        ("I do not know", "7", 0.0),
    ],
)
def test_gsm8k(text: str, answer: str, expected: float) -> None:
    assert _score(gsm8k, text, answer) == expected


def test_gsm8k_strict_needs_the_hash_line() -> None:
    sample = Sample([5], [6], [0.0], "stop", "v0", metadata={"answer": "7"})
    assert gsm8k(sample, "The answer is 7", sample.metadata, strict=True) == 0.0
    assert gsm8k(sample, "so\n#### 7", sample.metadata, strict=True) == 1.0


@pytest.mark.parametrize(
    "text,answer,expected",
    [
        ("so the result is \\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
        ("\\boxed{x^2+1}", "1+x^2", 1.0),
        ("\\boxed{0.25}", MATH_SOLUTION, 1.0),  # the reference's boxed answer
        ("\\boxed{3} no wait, \\boxed{4}", "4", 1.0),  # the last box
        ("\\boxed{3}", "4", 0.0),  # wrong
        ("\\boxed{\\frac{1}{3}}", MATH_SOLUTION, 0.0),
        ("The answer is 1/2.", "\\frac{1}{2}", 0.0),  # no boxed answer
    ],
)
def test_math(text: str, answer: str, expected: float) -> None:
    assert _score(math_reward, text, answer) == expected


def test_math_verify_is_an_alias_of_math() -> None:
    assert get_reward("math_verify") is get_reward("math") is math_reward


def test_math_without_math_verify_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify now raises ImportError
    for name in ("math", "dapo", "auto"):
        with pytest.raises(MissingOptionalDependency, match=r"pip install 'megatron-rl\[math\]'"):
            RewardSet.from_specs([name])
    RewardSet.from_specs(["gsm8k"])  # needs nothing


@pytest.mark.parametrize(
    "text,answer,expected",
    [
        ("Let me compute. 17 * 2 = 34.\nAnswer: 34", "34", 1.0),
        ("Answer: $\\frac{1}{2}$", "\\frac{1}{2}", 1.0),
        ("Answer: 1,000", "1000", 1.0),  # normalised
        ("Answer: 5 dollars", "5", 1.0),  # units removed
        ("Answer: x = 12", "12", 1.0),  # the part after '='
        ("Answer: 0.5", "\\frac{1}{2}", 1.0),  # math-verify decides
        ("Answer: 3\nno, wait.\nAnswer: 4", "4", 1.0),  # the last answer line
        ("Answer: 33", "34", -1.0),  # wrong
        ("so the result is 34", "34", -1.0),  # no answer line
        ("\\boxed{34}", "34", -1.0),
    ],
)
def test_dapo(text: str, answer: str, expected: float) -> None:
    assert _score(dapo, text, answer) == expected


@pytest.mark.parametrize(
    "source,text,answer,expected",
    [
        ("openai/gsm8k", "so\n#### 7", "x = 3 + 4\n#### 7", 1.0),  # gsm8k
        ("openai/gsm8k", "Answer: 8", "7", 0.0),
        ("lighteval/MATH", "\\boxed{0.5}", "\\frac{1}{2}", 1.0),  # math
        ("HuggingFaceH4/MATH-500", "Answer: 1/2", "\\frac{1}{2}", 0.0),  # math wants a box: 0, not dapo's -1
        ("DigitalLearningGmbH/MATH-lighteval", "\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
        ("math_dapo", "Answer: 12", "12", 1.0),  # dapo
        ("math_dapo", "the answer is 12", "12", -1.0),
        ("aime2024", "Answer: 13", "12", -1.0),  # aime* -> dapo
        ("aime_2025", "Answer: 12", "12", 1.0),
    ],
)
def test_auto_routes_by_data_source(source: str, text: str, answer: str, expected: float) -> None:
    assert _score(auto, text, answer, data_source=source) == expected


def test_auto_refuses_unknown_and_missing_sources() -> None:
    with pytest.raises(ValueError, match="data_source 'my/data' is not in its table"):
        _score(auto, "#### 7", "7", data_source="my/data")
    with pytest.raises(ValueError, match="data_source None"):
        _score(auto, "#### 7", "7")
    check_auto_sources({"openai/gsm8k", "aime2024", "lighteval/MATH"})
    with pytest.raises(ValueError, match=r"does not know data_source 'gsm8k', 'my/data'.*openai/gsm8k -> gsm8k"):
        check_auto_sources({"openai/gsm8k", "my/data", "gsm8k"})
    with pytest.raises(ValueError, match="no row has one"):
        check_auto_sources(set())
    # The run's reward refuses the loaded rows' sources at start-up (PromptData calls this); other rewards do not.
    assert RewardSet.from_specs(["auto"]).routes_by_data_source
    with pytest.raises(ValueError, match="'my/data'"):
        RewardSet.from_specs(["gsm8k", "auto"]).check_data_sources({"my/data"})
    RewardSet.from_specs(["gsm8k"]).check_data_sources({"my/data"})


def test_math_answer_reads_a_gsm8k_reference() -> None:
    """The lenient fallback compares with the number after the reference's `####`, not the whole solution."""
    assert math_answer(None, "#### 7", {"answer": "...\n#### 7"}) == 1.0  # type: ignore[arg-type]
    for text in ("\\boxed{7}", "The answer is 7", "so 3 + 4 = 7"):
        assert _score(math_answer, text, "3 + 4 = 7\n#### 7") == 1.0
    assert _score(math_answer, "#### 8", "3 + 4 = 7\n#### 7") == 0.0
    assert _score(math_answer, "#### 1,000", NATALIA.replace("72", "1000")) == 1.0


def test_auto_refuses_the_runs_unknown_sources_at_start_up(tmp_path: Path, tokenizer) -> None:
    rows = [
        {"question": "1 + 1?", "answer": "#### 2", "data_source": "openai/gsm8k"},
        {"question": "x?", "answer": "3", "data_source": "my/data"},
    ]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))

    def prompts(*overrides: str) -> PromptData:
        keys = ["model.hf_path=unused", f"data.train={train}", "data.prompt_key=question", *overrides]
        cfg = load_config(overrides=keys)
        return PromptData(cfg.data, cfg.rollout, cfg.algo, cfg.warmup, seed=cfg.trainer.seed, tokenizer=tokenizer)

    with pytest.raises(ValueError, match="data.reward=auto does not know data_source 'my/data'"):
        prompts("data.reward=auto")
    assert prompts("data.reward=gsm8k").reward_fn.parts[0].name == "gsm8k"  # other rewards do not ask
