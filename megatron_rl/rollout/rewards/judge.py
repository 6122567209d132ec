"""The `judge` reward: an LLM judge (a generative reward model) reads each prompt, response and reference answer
through a prompt template and writes a verdict, which a parser turns into the reward (verl's generative reward
model in its RewardLoop; slime's and TRL's LLM judges).

    data:
      reward: {name: judge, options: {url: http://127.0.0.1:30000}}                       # an OpenAI-style server
      reward: {name: judge, options: {model: /models/judge, verdict: score, max_score: 10}}  # a local engine

The judge is a frozen side model, never sent weights: either a server speaking the OpenAI chat-completions API
(`url`: SGLang's and vLLM's `/v1/chat/completions`, launched beside the rollout servers; a list spreads the requests
over several servers; `side:<name>` names a side model of `rollout.side_models`, whose URLs and API key file the
trainer fills in; `api_key_file` sends a bearer token), or `model`, an HF checkpoint the local engine loads once per
process on the rollout's device.
The template (`template`; `{prompt}`, `{response}`, `{answer}`) is sent as one user message: the server applies
the judge's chat template, the local engine its tokenizer's.

Verdicts (`verdict`), read from the judge's text by `parse_verdict`:

- `correct` (default): the last standalone word "correct" or "incorrect" (any case) gives 1 or 0;
- `score`: the last "score: N" (or "score = N"), N a number in [0, max_score], gives N / max_score.

A text without a readable verdict, a score outside [0, max_score], or a request that fails after its retries is a
failure of that sample: it scores 0 and counts toward `data.reward_failure_limit`, as every reward failure does.
The judge bounds its own time (`timeout_s` per request, `retries` with doubling backoff), so it runs in the
calling thread and `data.reward_timeout_s` does not apply to it.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from megatron_rl.rollout.rewards.user_functions import Failure

VERDICTS = ("correct", "score")
DEFAULT_TEMPLATE = (
    "You grade answers. Question:\n{prompt}\n\nReference answer: {answer}\n\nStudent's answer:\n{response}\n\n"
    "Is the student's answer correct? End with one line: 'Verdict: correct' or 'Verdict: incorrect'."
)
OPTIONS = {"url", "model", "template", "verdict", "max_score", "max_new_tokens", "temperature", "concurrency",
           "retries", "backoff_s", "timeout_s", "api_key_file"}  # fmt: skip
_CORRECT = re.compile(r"\b(incorrect|correct)\b", re.IGNORECASE)
_SCORE = re.compile(r"\bscore\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)


class JudgeError(RuntimeError):
    """The judge refused the request (HTTP 4xx other than 429): a wrong key, model name or request."""


def parse_verdict(text: str, verdict: str = "correct", max_score: float = 10.0) -> float | None:
    """The reward a judge's `text` gives under `verdict` (see the module docstring); None when it has none."""
    if verdict == "correct":
        words = _CORRECT.findall(text)
        return float(words[-1].lower() == "correct") if words else None
    scores = _SCORE.findall(text)
    if not scores:
        return None
    value = float(scores[-1])
    return value / max_score if 0 <= value <= max_score else None


def judge(
    prompts: list,
    completions: list,
    prompt_texts: list,
    completion_ids: list | None = None,
    answer: list | None = None,
    *,
    url: str | list[str] | None = None,
    model: str | None = None,
    template: str = DEFAULT_TEMPLATE,
    verdict: str = "correct",
    max_score: float = 10.0,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    concurrency: int = 8,
    retries: int = 3,
    backoff_s: float = 0.5,
    timeout_s: float = 60.0,
    api_key_file: str | None = None,
    **columns: list,
) -> list[float | Failure]:
    """The judge's reward of each sample (TRL's batched arguments, `user_functions`), or a `Failure`."""
    answers = answer if answer is not None else [None] * len(completions)
    texts = [_as_text(c) for c in completions]
    triples = zip(prompt_texts, texts, answers, strict=True)
    requests = [template.format(prompt=p, response=r, answer=a) for p, r, a in triples]
    if model is not None:
        replies: list[str | Failure] = list(_local_judge(model).ask(requests, max_new_tokens, temperature))
    else:
        assert url is not None  # validate_options requires one of them
        urls = [url] if isinstance(url, str) else url
        if any(u.startswith("side:") for u in urls):
            raise JudgeError(f"judge url {url!r} names a side model the trainer resolves; give the server's URL here")
        servers = [_ServerJudge(u, api_key_file, timeout_s, retries, backoff_s) for u in urls]
        with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(requests)))) as pool:
            asked = [(servers[i % len(servers)], r) for i, r in enumerate(requests)]  # spread over the servers
            replies = list(pool.map(lambda sr: sr[0].ask(sr[1], max_new_tokens, temperature), asked))
    rewards: list[float | Failure] = []
    for reply in replies:
        if isinstance(reply, Failure):
            rewards.append(reply)
            continue
        value = parse_verdict(reply, verdict, max_score)
        unreadable = Failure(f"the judge's reply has no {verdict} verdict: {reply[-200:]!r}")
        rewards.append(unreadable if value is None else value)
    return rewards


def validate_options(options: Mapping[str, Any]) -> None:
    """A one-line ValueError naming a missing, unknown or ill-formed option of `judge` and its fix."""
    unknown = sorted(set(options) - OPTIONS)
    if unknown:
        raise ValueError(f"judge reward: unknown options {unknown}; accepted: {sorted(OPTIONS)}")
    if (options.get("url") is None) == (options.get("model") is None):
        raise ValueError(
            "judge reward: set exactly one of options.url (an OpenAI-style server, e.g. http://127.0.0.1:30000) "
            "and options.model (an HF checkpoint the local engine loads)"
        )
    if options.get("verdict", "correct") not in VERDICTS:
        raise ValueError(f"judge reward: options.verdict={options['verdict']!r}; use one of {list(VERDICTS)}")
    if options.get("model") is not None and not (Path(options["model"]) / "config.json").is_file():
        raise ValueError(f"judge reward: options.model={options['model']!r} is not an HF checkpoint (no config.json)")
    template = options.get("template", DEFAULT_TEMPLATE)
    try:
        template.format(prompt="", response="", answer="")
    except (KeyError, IndexError, ValueError) as err:
        raise ValueError(
            f"judge reward: options.template has a placeholder other than {{prompt}}, {{response}}, {{answer}} "
            f"({err!r}); double a literal brace as {{{{ }}}}"
        ) from err


judge.validate_options = validate_options  # type: ignore[attr-defined]


def _as_text(completion: Any) -> str:
    """A completion as TRL passes it: a string, or chat messages (their contents joined)."""
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content", "") for m in completion)


class _ServerJudge:
    """One judge server's `/v1/chat/completions`, with retries on 5xx, 429, connection errors and timeouts."""

    def __init__(self, url: str, api_key_file: str | None, timeout_s: float, retries: int, backoff_s: float):
        self.endpoint = url.rstrip("/") + "/v1/chat/completions"
        self.headers = {"Content-Type": "application/json"}
        if api_key_file is not None:
            self.headers["Authorization"] = f"Bearer {Path(api_key_file).read_text().strip()}"
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s

    def ask(self, content: str, max_new_tokens: int, temperature: float) -> str | Failure:
        body = {"model": "default", "messages": [{"role": "user", "content": content}],
                "max_tokens": max_new_tokens, "temperature": temperature}  # fmt: skip
        data = json.dumps(body).encode()
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), 30.0))  # backoff before a retry
            request = urllib.request.Request(self.endpoint, data=data, headers=self.headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                    return str(json.loads(reply.read())["choices"][0]["message"]["content"])
            except urllib.error.HTTPError as err:
                if 400 <= err.code < 500 and err.code != 429:
                    detail = err.read()[:200]
                    raise JudgeError(f"HTTP {err.code} from the judge at {self.endpoint}: {detail!r}") from err
                problem = f"HTTP {err.code}"
            except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
                problem = repr(err)
            except (KeyError, IndexError, TypeError, ValueError) as err:
                return Failure(f"the judge at {self.endpoint} replied outside the chat-completions shape: {err!r}")
        return Failure(f"the judge at {self.endpoint} failed {self.retries + 1} times ({problem})",
                       timed_out="timed out" in problem)  # fmt: skip


class _LocalJudge:
    """A judge checkpoint on the local engine (loaded once per process), its tokenizer's chat template applied."""

    def __init__(self, model: str):
        from transformers import AutoTokenizer

        from megatron_rl.accelerator import device
        from megatron_rl.rollout.engines.local_engine import LocalEngine

        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.engine = LocalEngine(model, device=device(), weight_version="judge")
        self.lock = threading.Lock()

    def ask(self, contents: list[str], max_new_tokens: int, temperature: float) -> list[str]:
        from megatron_rl.config.sampling import SamplingParams

        prompts = [self._ids(c) for c in contents]
        stop = tuple(i for i in (self.tokenizer.eos_token_id,) if i is not None)
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=stop, seed=0)
        with self.lock:
            samples = self.engine.generate(prompts, params)
        return [str(self.tokenizer.decode(s.response_ids, skip_special_tokens=True)) for s in samples]

    def _ids(self, content: str) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                     tokenize=True)  # fmt: skip
            return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
        return list(self.tokenizer(content)["input_ids"])


@functools.lru_cache(maxsize=2)
def _local_judge(model: str) -> _LocalJudge:
    return _LocalJudge(model)
