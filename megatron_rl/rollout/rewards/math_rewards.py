"""Math rewards with the conventions of the datasets people train on: GSM8K's `#### N`, MATH's `\\boxed{}` checked by
math-verify, DAPO's "Answer:" line (+1 / -1), `auto` routing by the row's `data_source` (verl's names), and the
lenient `math_answer`.

Each is `fn(sample, text, metadata) -> float` with the reference in `metadata["answer"]`, and exposes
`fn.extract_answer(text) -> str | None`: the response's final answer in a canonical form, the key maj@k votes on
(`RewardSet.extract_answer`); None when the response states none.
"""

from __future__ import annotations

import functools
import math
import re
import threading
from collections.abc import Callable, Mapping
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

from megatron_rl.optional_deps import require
from megatron_rl.rollout.rewards.registry import register_reward
from megatron_rl.rollout.sample import Sample


# ---------------------------------------------------------------------------------------------- gsm8k
@register_reward("gsm8k")
def gsm8k(sample: Sample, text: str, metadata: Mapping[str, Any], *, strict: bool = False) -> float:
    """1.0 if the response's `#### N` answer (else its last number) equals the reference's, else 0.0.

    GSM8K's convention (OpenAI's grade-school-math; verl's gsm8k.py): the number after the last `####`, else (unless
    `strict`) the response's last number; the reference is the worked solution ending in `#### N` or the bare
    number; commas, `$` and trailing zeros (`72.00`) are ignored."""
    predicted = gsm8k_answer(text, strict=strict)
    reference = str(metadata["answer"])
    expected = gsm8k_answer(reference, strict=True) if "####" in reference else reference
    a, b = _decimal(predicted), _decimal(expected)
    if a is not None and b is not None:
        return float(a == b)
    return float(predicted is not None and expected is not None and predicted.strip() == expected.strip())


_HASH_ANSWER = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")
_ANY_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def gsm8k_answer(text: str, *, strict: bool = False) -> str | None:
    """The number after the last `####` in `text`, else (not `strict`) its last number, else None."""
    found = _HASH_ANSWER.findall(text)
    if not found and not strict:
        found = _ANY_NUMBER.findall(text)
    return found[-1] if found else None


def canonical_gsm8k_answer(text: str, *, strict: bool = False) -> str | None:
    """gsm8k's answer (`gsm8k_answer`) as a canonical number, so that '1,000', '$1000' and '1000.0' all give '1000'
    (the reward compares them as equal decimals); None when there is none."""
    answer = gsm8k_answer(text, strict=strict)
    value = _decimal(answer)
    if value is None:
        return answer
    return "0" if value == 0 else format(value.normalize(), "f")


gsm8k.extract_answer = canonical_gsm8k_answer


def _decimal(s: str | None) -> Decimal | None:
    if s is None:
        return None
    try:
        return Decimal(s.strip().replace(",", "").replace("$", "").rstrip("."))
    except InvalidOperation:
        return None


# ---------------------------------------------------------------------------------------------- math
@register_reward("math", requires="math_verify")
def math_reward(sample: Sample, text: str, metadata: Mapping[str, Any]) -> float:
    """1.0 if the response's last `\\boxed{}` equals the reference by math-verify, else 0.0.

    MATH's convention (Hendrycks et al. 2021; verl's math_verify.py): the last boxed answer, compared by
    math-verify, Hugging Face's checker (`0.5` = `\\frac{1}{2}`, `2\\sqrt{2}` = `\\sqrt{8}`); the reference may be
    a bare answer or a solution with a `\\boxed{}`. A response without a boxed answer scores 0."""
    boxed = last_boxed(text)
    return float(boxed is not None and math_equal(boxed, str(metadata["answer"])))


register_reward("math_verify", requires="math_verify")(math_reward)

# LaTeX that never changes an answer: \left / \right (not \leftarrow), spacing commands, whitespace.
_LATEX_SPACING = re.compile(r"\\(?:left|right)(?![A-Za-z])|\\[!,;: ]|\s+")


def canonical_boxed_answer(text: str) -> str | None:
    """The last `\\boxed{}`'s content lightly normalised for voting: whitespace, `\\left` / `\\right`, spacing commands
    (`\\!`, `\\,`, ...) and a trailing '.' removed, `\\dfrac` / `\\tfrac` as `\\frac`; None without a boxed answer.
    Answers that math-verify equates but that are written differently (`0.5` and `\\frac{1}{2}`) vote apart."""
    boxed = last_boxed(text)
    if boxed is None:
        return None
    answer = _LATEX_SPACING.sub("", boxed).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").rstrip(".")
    return answer or None


math_reward.extract_answer = canonical_boxed_answer


def math_equal(predicted: str, reference: str) -> bool:
    """math-verify's verdict on the answer `predicted` (LaTeX, no `\\boxed`) against `reference` (a bare answer, a
    `$...$` expression, or a solution with a `\\boxed{}`)."""
    parse, verify = _math_verify_functions()
    if "\\boxed" not in reference and "\\fbox" not in reference and "$" not in reference:
        reference = f"\\boxed{{{reference}}}"
    # Its own timeouts (5 s) use SIGALRM, which works in a main thread only (a worker process's calls run there);
    # elsewhere the scorer's data.reward_timeout_s is the limit.
    limit = _own_timeout()
    gold = parse(reference, parsing_timeout=limit)
    answer = parse(f"\\boxed{{{predicted}}}", parsing_timeout=limit)
    return bool(gold and answer and verify(gold, answer, timeout_seconds=limit))


def _own_timeout() -> int | None:
    return 5 if threading.current_thread() is threading.main_thread() else None


@functools.cache
def _math_verify_functions() -> tuple[Callable[..., Any], Callable[..., Any]]:
    module = require("math_verify")
    return module.parse, module.verify


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{..}` (or `\\fbox{..}`) in `text`, nested braces kept; None if there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
        i += 1
    return None  # unbalanced braces


# ---------------------------------------------------------------------------------------------- dapo
@register_reward("dapo", requires="math_verify")
def dapo(sample: Sample, text: str, metadata: Mapping[str, Any]) -> float:
    """+1.0 if the response's last "Answer: X" line equals the reference, else -1.0 (also with no answer line).

    DAPO's convention (Yu et al. 2025, arXiv 2503.14476; verl's math_dapo.py): the last "Answer: X" line of the
    response's last 300 characters (DAPO-Math-17k prompts ask for it), normalised as Minerva's / verl's
    `normalize_final_answer` and compared with the normalised reference; math-verify decides what the string check
    does not."""
    found = _ANSWER_LINE.findall(text[-300:])  # verl's clip: the longest MATH-500 answer has 159 characters
    if not found:
        return -1.0
    predicted, reference = normalize_final_answer(found[-1]), normalize_final_answer(str(metadata["answer"]))
    return 1.0 if predicted == reference or math_equal(predicted, reference) else -1.0


_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
# Minerva's normalisation (Lewkowycz et al. 2022, appendix D; as in lm-eval-harness and verl): spaces, articles,
# dollar signs, units and LaTeX wrappers go; shorthand \fracab / \sqrta is expanded.
_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)  # fmt: skip
_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
    "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots",
)  # fmt: skip


def normalize_final_answer(answer: str) -> str:
    """A final answer in the Minerva form: the part after the last `=`, units and LaTeX wrappers removed, `\\fracab`
    as `\\frac{a}{b}`, `1,000` as `1000`."""
    answer = answer.split("=")[-1]
    for old, new in _SUBSTITUTIONS:
        answer = answer.replace(old, new)
    for word in _REMOVED:
        answer = answer.replace(word, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$", answer)  # the first $...$ expression
    for wrapper in ("text", "textbf", "overline"):
        answer = re.sub(rf"\\{wrapper}\{{(.*?)\}}", r"\1", answer)
    answer = re.sub(r"\\boxed\{(.*)\}", r"\1", answer)
    answer = re.sub(r"(frac)([^{])(.)", r"frac{\2}{\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", r"sqrt{\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def canonical_dapo_answer(text: str) -> str | None:
    """dapo's answer as the reward compares it: the last "Answer: X" line of the last 300 characters, normalised by
    `normalize_final_answer`; None without one."""
    found = _ANSWER_LINE.findall(text[-300:])
    return (normalize_final_answer(found[-1]) or None) if found else None


dapo.extract_answer = canonical_dapo_answer


# ---------------------------------------------------------------------------------------------- auto
# verl's default_compute_score names: data_source -> reward. A closed table: any other source is refused.
AUTO_ROUTES: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math_dapo": "dapo",
}
AUTO_PREFIXES: dict[str, str] = {"aime": "dapo"}  # aime24, aime_2025, ...
_ROUTED: dict[str, Callable[[Sample, str, Mapping[str, Any]], float]] = {
    "gsm8k": gsm8k,
    "math": math_reward,
    "dapo": dapo,
}


@register_reward("auto", requires="math_verify")
def auto(sample: Sample, text: str, metadata: Mapping[str, Any]) -> float:
    """The row's `data_source` picks gsm8k, math or dapo (verl's names); other sources are refused at start-up.

    verl's routing (default_compute_score): openai/gsm8k -> gsm8k; lighteval/MATH, DigitalLearningGmbH/MATH-lighteval,
    HuggingFaceH4/MATH-500 -> math; math_dapo, aime* -> dapo."""
    source = metadata.get("data_source")
    name = route_data_source(source)
    if name is None:
        raise ValueError(f"reward auto: data_source {source!r} is not in its table ({_table()})")
    return _ROUTED[name](sample, text, metadata)


def canonical_routed_answer(text: str, *, sample: Sample | None = None) -> str | None:
    """The canonical answer of the reward that `sample`'s `data_source` routes to (`auto`'s table); it needs
    `sample=`, as `RewardSet.extract_answer` passes it."""
    if sample is None:
        raise ValueError("reward auto's extract_answer picks its reward by the row's data_source: pass sample=")
    source = sample.metadata.get("data_source")
    name = route_data_source(source)
    if name is None:
        raise ValueError(f"reward auto: data_source {source!r} is not in its table ({_table()})")
    return _ROUTED_ANSWERS[name](text)


_ROUTED_ANSWERS: dict[str, Callable[[str], str | None]] = {
    "gsm8k": canonical_gsm8k_answer,
    "math": canonical_boxed_answer,
    "dapo": canonical_dapo_answer,
}
auto.extract_answer = canonical_routed_answer


def route_data_source(source: object) -> str | None:
    """The reward `auto` uses for `source`, or None when the table has no entry."""
    if not isinstance(source, str):
        return None
    if source in AUTO_ROUTES:
        return AUTO_ROUTES[source]
    return next((name for prefix, name in AUTO_PREFIXES.items() if source.startswith(prefix)), None)


def check_auto_sources(sources: set[str]) -> None:
    """A ValueError unless every `data_source` in `sources` (non-empty) is in `auto`'s table."""
    if not sources:
        raise ValueError(
            "data.reward=auto picks each row's reward by its data_source column, but no row has one: add data_source "
            f"to the rows ({_table()}) or set data.reward to one reward (gsm8k, math, dapo)"
        )
    unknown = sorted(s for s in sources if route_data_source(s) is None)
    if unknown:
        raise ValueError(
            f"data.reward=auto does not know data_source {', '.join(map(repr, unknown))}: its table is {_table()}; "
            "set data.reward to a reward for these rows (e.g. math) or a list of rewards"
        )


def _table() -> str:
    routes = [f"{source} -> {name}" for source, name in AUTO_ROUTES.items()]
    routes += [f"{prefix}* -> {name}" for prefix, name in AUTO_PREFIXES.items()]
    return ", ".join(routes)


# ---------------------------------------------------------------------------------------------- math_answer
@register_reward("math_answer")
def math_answer(sample: Sample, text: str, metadata: Mapping[str, Any]) -> float:
    """A lenient fallback: 1.0 if the response's final answer, in any common format, equals the reference, else 0.0.

    The response's last `\\boxed{..}`, else its last "answer: X" / "answer is X", else its last number, against the
    reference's `#### N`, else its last `\\boxed{}`, else the whole reference; compared as numbers when both parse
    (decimals, fractions, `\\frac{a}{b}`, `1,000`), else as normalised strings; math-verify's verdict, when
    installed, is also accepted. Prefer gsm8k, math or dapo when the data follows their convention."""
    reference = str(metadata["answer"])
    expected = gsm8k_answer(reference, strict=True) or last_boxed(reference) or reference
    predicted = extract_final_answer(text)
    if predicted is not None and answers_match(predicted, expected):
        return 1.0
    verify = _math_verify()
    return float(verify is not None and verify(reference, text))


_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*\$?([^\n$]+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")


def extract_final_answer(text: str) -> str | None:
    """The final answer in `text` (see `math_answer`), or None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    stated = _ANSWER_IS.findall(text)
    if stated:
        return stated[-1].strip().rstrip(".").strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].strip() if numbers else None


def canonical_math_answer(text: str) -> str | None:
    """math_answer's final answer (`extract_final_answer`) as the reward compares it: a number ('1/2', '\\frac{1}{2}'
    and '0.5' give '0.5'; 12 significant digits) when it parses as one, else the normalised string; None without
    one."""
    answer = extract_final_answer(text)
    if answer is None:
        return None
    number = _as_number(answer)
    if number is not None:
        return f"{number + 0.0:.12g}"  # + 0.0: -0.0 votes with 0.0
    return _normalise(answer) or None


math_answer.extract_answer = canonical_math_answer


def answers_match(predicted: str, reference: str) -> bool:
    """Equal as numbers (relative 1e-6) when both parse as numbers, else as normalised strings."""
    a, b = _as_number(predicted), _as_number(reference)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    return _normalise(predicted) == _normalise(reference)


def _normalise(s: str) -> str:
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = re.sub(r"\\(left|right|!|,|;|\s)", "", s).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return re.sub(r"\s+", "", s).strip("$.").lower()


def _as_number(s: str) -> float | None:
    s = _normalise(s).replace(",", "")
    frac = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s) or re.fullmatch(r"(-?)\\frac(\d)(\d)", s)
    try:
        if frac:
            value = Fraction(int(frac[2]), int(frac[3]))
            return float(-value if frac[1] else value)
        if s.endswith("%"):
            return float(s[:-1]) / 100
        return float(Fraction(s))
    except (ValueError, ZeroDivisionError):
        return None


@functools.cache
def _math_verify() -> Callable[[str, str], bool] | None:
    """math-verify's check of a whole text against a reference when the package is installed (optional here)."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None

    def check(reference: str, text: str) -> bool:
        limit = _own_timeout()
        gold, answer = parse(reference, parsing_timeout=limit), parse(text, parsing_timeout=limit)
        return bool(verify(gold, answer, timeout_seconds=limit))

    return check
