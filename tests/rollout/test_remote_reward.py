"""The `remote` reward against the reference service (examples/reward_server.py) in its own process, over real HTTP:
batched requests, retries of a flaky service, a hung one timing out into the failure limit, the bearer key, and
options refused when the plugins are checked."""

from __future__ import annotations

import json
import queue
import re
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.config.loader import load_config
from megatron_rl.config.schema import RewardSpec
from megatron_rl.rollout.plugin_check import check_plugins
from megatron_rl.rollout.rewards import RewardFailureError, RewardSet, build_reward, compute_rewards
from megatron_rl.rollout.rewards.remote import _rewards
from megatron_rl.rollout.rewards.user_functions import Failure
from megatron_rl.rollout.sample import Sample

SERVER = Path(__file__).parents[2] / "examples" / "reward_server.py"
# (response, answer, the reference service's score: gsm8k's final number against the answer)
CASES = [
    ("The answer is 42", "42", 1.0),
    ("I think 41", "42", 0.0),
    ("3 + 4 = 7\n#### 7", "7", 1.0),
    ("1,000 apples", "1000", 1.0),
    ("no number here", "5", 0.0),
    ("12 then 13", "12", 0.0),
    ("x = 8", None, 0.0),
]


@contextmanager
def reward_server(*flags: str) -> Iterator[str]:
    """The reference service on a free port, until the block ends; yields its base URL once it says it listens."""
    proc = subprocess.Popen(
        [sys.executable, str(SERVER), "--port", "0", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout or ()], daemon=True).start()
    try:
        first = lines.get(timeout=60)
        assert first.startswith("listening on http://127.0.0.1:"), first
        yield first.split()[-1]
    finally:
        proc.kill()
        proc.wait()


def stats(base: str) -> dict[str, int]:
    with urllib.request.urlopen(f"{base}/stats", timeout=10) as reply:
        return json.loads(reply.read())


def samples(tokenizer, cases=CASES, **columns: list) -> list[Sample]:
    """One sample per case: the response's tokens and a stop token; the answer and `columns` as metadata."""
    out = []
    for i, (text, answer, _) in enumerate(cases):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        metadata = {"prompt": f"question {i}", "answer": answer, **{k: v[i] for k, v in columns.items()}}
        out.append(Sample([5, 6], ids, [-0.5] * len(ids), "stop", "v0", metadata=metadata))
    return out


def remote_set(url: str, **options) -> RewardSet:
    return RewardSet.from_specs([RewardSpec("remote", 1.0, {"url": url, **options})])


def test_a_batch_is_scored_in_ceil_n_over_batch_size_requests(tokenizer) -> None:
    with reward_server() as base:
        url = f"{base}/score"
        cfg = load_config(
            overrides=[
                "model.hf_path=unused",
                f"data.reward=[{{name: remote, weight: 2.0, options: {{url: '{url}', batch_size: 3, concurrency: 2}}}},"
                " {name: exact_match, weight: 1.0}]",
            ]
        )
        check_plugins(cfg.data, cfg.rollout)
        reward = build_reward(cfg.data)
        assert [(p.name, p.runner, p.style) for p in reward.parts] == [
            ("remote", "inline", "batched"),
            ("exact_match", "inline", "sample"),
        ]
        batch = samples(tokenizer, data_source=["openai/gsm8k"] * len(CASES))
        stats_ = reward.score(batch, tokenizer)
        expected = [score for _, _, score in CASES]
        assert [s.reward_parts["remote"] for s in batch] == expected
        assert [s.reward for s in batch] == [2.0 * e for e in expected]  # no response equals its answer exactly
        assert stats_.errors == stats_.timeouts == 0
        assert stats(base) == {"requests": 3, "samples": 7}  # ceil(7 / 3)
        # Chat data: the completion is an assistant message; its text is what the service scores.
        chat = [{"role": "user", "content": "6 * 7?"}]
        two = samples(tokenizer, CASES[:2], prompt_messages=[chat, chat])
        compute_rewards(two, remote_set(url), tokenizer)
        assert [s.reward for s in two] == [1.0, 0.0]
        assert stats(base) == {"requests": 4, "samples": 9}


def test_a_flaky_service_is_retried(tokenizer) -> None:
    with reward_server("--fail-first", "2") as base:
        batch = samples(tokenizer, CASES[:4])
        reward = remote_set(f"{base}/score", batch_size=2, concurrency=1, backoff_s=0.01)
        result = compute_rewards(batch, reward, tokenizer, failure_limit=0.0)  # no failure allowed
        assert [s.reward for s in batch] == [1.0, 0.0, 1.0, 1.0]
        assert result.errors == result.timeouts == 0
        assert stats(base) == {"requests": 4, "samples": 4}  # two 503s, then the two requests


def test_a_hung_service_times_out_into_the_failure_limit(tokenizer) -> None:
    with reward_server("--hang") as base:
        options = {"batch_size": 1, "concurrency": 2, "timeout_s": 0.3, "retries": 1, "backoff_s": 0.05}
        batch = samples(tokenizer, CASES[:6])
        result = compute_rewards(batch, remote_set(f"{base}/score", **options), tokenizer, failure_limit=1.0)
        assert [s.reward for s in batch] == [0.0] * 6
        assert "failed 2 times; the last: timed out after 0.3 s (options.timeout_s)" in (result.first_error or "")
        # The two requests in flight used their 2 attempts (timeouts); the batch's other 4 were not sent (errors).
        assert result.timeouts + result.errors == 6 and 1 <= result.timeouts <= 2
        assert 2 <= stats(base)["requests"] <= 4
        cfg = load_config(
            overrides=[
                "model.hf_path=unused",
                f"data.reward={{name: remote, options: {json.dumps({'url': f'{base}/score', **options})}}}",
                "data.reward_failure_limit=0.1",
            ]
        )
        with pytest.raises(RewardFailureError) as err:
            compute_rewards(samples(tokenizer, CASES[:6]), build_reward(cfg.data), tokenizer)
        message = str(err.value)
        assert "reward 'remote' failed on 6 of 6 samples" in message and "timed out after 0.3 s" in message
        assert "data.reward_timeout_s" not in message  # remote's own timeout_s applies, not the worker pool's


def test_the_bearer_key_is_sent_and_a_wrong_one_is_a_clear_4xx(tokenizer, tmp_path: Path) -> None:
    right, wrong = tmp_path / "right.key", tmp_path / "wrong.key"
    right.write_text("s3cret-token\n")
    wrong.write_text("not-the-token\n")
    with reward_server("--api-key-file", str(right)) as base:
        batch = samples(tokenizer, CASES[:3])
        compute_rewards(batch, remote_set(f"{base}/score", api_key_file=str(right)), tokenizer, failure_limit=0.0)
        assert [s.reward for s in batch] == [1.0, 0.0, 1.0]
        before = stats(base)["requests"]
        reward = remote_set(f"{base}/score", api_key_file=str(wrong), backoff_s=0.01)
        with pytest.raises(RewardFailureError) as err:
            compute_rewards(samples(tokenizer, CASES[:3]), reward, tokenizer, failure_limit=0.1)
        message = str(err.value)
        assert "RemoteRewardError: HTTP 401 Unauthorized from" in message
        assert "missing or wrong bearer token" in message
        assert "not-the-token" not in message and "s3cret" not in message
        assert stats(base)["requests"] == before + 1  # a 4xx is not retried


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            "{url: 'localhost:8000/score'}",
            "options.url='localhost:8000/score' is not an http:// or https:// URL: set options.url of the remote "
            "reward to the service's address, e.g. url: http://127.0.0.1:8000/score",
        ),
        ("{batch_size: 8}", "options.url is missing: set options.url of the remote reward"),
        ("{url: 'http://h:1/s', batchsize: 8}", "unknown options ['batchsize']: remote takes url, batch_size,"),
        ("{url: 'http://h:1/s', concurrency: 0}", "options.concurrency=0: set a whole number >= 1 (default 4)"),
    ],
)
def test_bad_options_are_refused_in_one_line_when_plugins_are_checked(options: str, expected: str) -> None:
    cfg = load_config(overrides=["model.hf_path=unused", f"data.reward={{name: remote, options: {options}}}"])
    with pytest.raises(ConfigError) as err:
        check_plugins(cfg.data, cfg.rollout)
    assert str(err.value).startswith(f"data.reward='remote': reward 'remote': {expected}")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=f"^reward 'remote': {re.escape(expected)}"):
        build_reward(cfg.data)  # the same check where the reward is built


def test_a_reply_outside_the_contract_fails_the_samples_it_names() -> None:
    assert _rewards(b'{"rewards": [1, 0.5]}', 2) == [1.0, 0.5]
    short = _rewards(b'{"rewards": [1]}', 2)
    assert short == [Failure("the reply has 1 rewards for the request's 2 samples")] * 2
    mixed = _rewards(b'{"rewards": [1, "high", null, true]}', 4)
    assert mixed[0] == 1.0
    assert [m.message for m in mixed[1:]] == [  # type: ignore[union-attr]
        "the reply's rewards[1]: returned 'high' (str), not a number",
        "the reply's rewards[2]: returned None (NoneType), not a number",
        "the reply's rewards[3]: true/false is not a number",
    ]
    garbled = _rewards(b"<html>busy</html>", 1)
    assert garbled == [Failure("the reply is not {\"rewards\": [number, ...]}: '<html>busy</html>'")]
