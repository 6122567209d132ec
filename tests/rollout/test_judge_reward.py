"""The `judge` reward (an LLM judge): its verdict parser on documented and malformed verdicts; a judge server
speaking the OpenAI chat-completions API (a double: no LLM that judges arithmetic runs on these CPUs) scoring a
batch through the framework, retried when flaky; the local-engine judge on the tiny model, whose unreadable
verdicts are failures that stop scoring over the failure limit; options refused when the plugins are checked."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.config.loader import load_config
from megatron_rl.config.schema import RewardSpec
from megatron_rl.rollout.plugin_check import check_plugins
from megatron_rl.rollout.rewards import RewardFailureError, RewardSet, compute_rewards
from megatron_rl.rollout.rewards.judge import JudgeError, judge, parse_verdict
from megatron_rl.rollout.sample import Sample
from megatron_rl.tiny_model import make_tiny_qwen3_moe


@pytest.mark.parametrize(
    ("text", "verdict", "expected"),
    [
        ("The answer matches.\nVerdict: correct", "correct", 1.0),
        ("Verdict: INCORRECT", "correct", 0.0),
        ("First I thought correct, but on reflection: incorrect", "correct", 0.0),  # the last word wins
        ("It is incorrectly rounded... Verdict: correct", "correct", 1.0),  # 'incorrectly' is not a verdict
        ("no verdict here", "correct", None),
        ("", "correct", None),
        ("Reasoning...\nScore: 7", "score", 0.7),
        ("score = 10", "score", 1.0),
        ("Score: 3.5 then Score: 8", "score", 0.8),
        ("Score: 11", "score", None),  # outside [0, max_score]
        ("Score: -1", "score", None),
        ("seven out of ten", "score", None),
    ],
)
def test_parse_verdict(text: str, verdict: str, expected: float | None) -> None:
    assert parse_verdict(text, verdict, max_score=10) == expected


class _JudgeDouble(BaseHTTPRequestHandler):
    """`POST /v1/chat/completions` as SGLang and vLLM serve it: it compares the default template's student answer
    with its reference answer and says so; the first `fail_first` requests get HTTP 503."""

    fail_first = 0
    requests = 0
    lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            type(self).requests += 1
            failing = type(self).requests <= self.fail_first
        if failing:
            self.send_error(503)
            return
        content = body["messages"][-1]["content"]
        reference = re.search(r"Reference answer: (.*)\n", content).group(1)
        student = re.search(r"Student's answer:\n(.*)\n\n", content, re.S).group(1)
        words = "Verdict: correct" if student.strip() == reference.strip() else "Verdict: incorrect"
        if "garbled" in student:
            words = "I cannot tell."
        reply = {"choices": [{"message": {"role": "assistant", "content": words}}]}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


_SERVED: dict[str, type[_JudgeDouble]] = {}  # url -> its handler class (its request count)


@contextmanager
def judge_server(fail_first: int = 0) -> Iterator[str]:
    handler = type("Judge", (_JudgeDouble,), {"fail_first": fail_first, "requests": 0, "lock": threading.Lock()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)  # bound and listening before the thread starts
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    _SERVED[url] = handler
    try:
        yield url
    finally:
        server.shutdown()
        thread.join()


def _samples(tokenizer, cases: list[tuple[str, str]]) -> list[Sample]:
    out = []
    for i, (text, answer) in enumerate(cases):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out.append(Sample([5, 6], ids, [-0.5] * len(ids), "stop", "v0", metadata={"prompt": f"q{i}", "answer": answer}))
    return out


def test_a_judge_server_scores_a_batch_and_a_flaky_one_is_retried(tokenizer) -> None:
    cases = [("42", "42"), ("41", "42"), ("7", "7"), ("garbled", "3")]
    with judge_server(fail_first=2) as url:
        cfg = load_config(overrides=["model.hf_path=unused", f"data.reward={{name: judge, options: {{url: '{url}'}}}}"])
        check_plugins(cfg.data, cfg.rollout)
        batch = _samples(tokenizer, cases)
        reward = RewardSet.from_specs([RewardSpec("judge", 1.0, {"url": url, "backoff_s": 0.01, "concurrency": 1})])
        stats = compute_rewards(batch, reward, tokenizer, failure_limit=0.5)
        assert [s.reward for s in batch] == [1.0, 0.0, 1.0, 0.0]  # the garbled one: no verdict, a failure scoring 0
        assert stats.errors == 1


def test_a_judge_of_several_servers_spreads_the_batch_over_them(tokenizer) -> None:
    """`url` as a list (what `side:<name>` of a side model with several servers becomes): each server gets its share."""
    cases = [("42", "42"), ("41", "42"), ("7", "7"), ("8", "7")]
    with judge_server() as first, judge_server() as second:
        reward = RewardSet.from_specs([RewardSpec("judge", 1.0, {"url": [first, second], "concurrency": 2})])
        batch = _samples(tokenizer, cases)
        compute_rewards(batch, reward, tokenizer, failure_limit=0.0)
        assert [s.reward for s in batch] == [1.0, 0.0, 1.0, 0.0]
        assert [_requests(first), _requests(second)] == [2, 2]
    with pytest.raises(JudgeError, match="names a side model the trainer resolves"):
        judge(["q"], ["a"], ["q"], url="side:judge")


def _requests(url: str) -> int:
    return _SERVED[url].requests


def test_the_local_engine_judge_fails_unreadable_verdicts_into_the_failure_limit(tmp_path: Path, tokenizer) -> None:
    """The tiny random model as the judge: it writes no verdict, so every sample is a failure (named with the
    judge's text), and scoring stops over `data.reward_failure_limit`."""
    model = make_tiny_qwen3_moe(tmp_path / "judge", seed=3)
    out = judge(["q"], ["42"], ["q"], answer=["42"], model=str(model), max_new_tokens=8)
    assert len(out) == 1 and "has no correct verdict" in out[0].message
    reward = RewardSet.from_specs([RewardSpec("judge", 1.0, {"model": str(model), "max_new_tokens": 8})])
    with pytest.raises(RewardFailureError, match="judge"):
        compute_rewards(_samples(tokenizer, [("42", "42"), ("1", "2")]), reward, tokenizer, failure_limit=0.5)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ("{}", "set exactly one of options.url"),
        ("{url: 'http://x', model: /m}", "set exactly one of options.url"),
        ("{url: 'http://x', verdict: maybe}", "options.verdict='maybe'"),
        ("{url: 'http://x', template: 'grade {answr}'}", "options.template has a placeholder"),
        ("{url: 'http://x', colour: red}", "unknown options ['colour']"),
    ],
)
def test_bad_judge_options_are_refused_when_the_plugins_are_checked(options: str, message: str) -> None:
    cfg = load_config(overrides=["model.hf_path=unused", f"data.reward={{name: judge, options: {options}}}"])
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_plugins(cfg.data, cfg.rollout)
