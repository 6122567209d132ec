"""The `remote` reward: a reward service scores the responses over HTTP (slime's `--rm-type remote_rm --rm-url`,
verl's reward server).

    data:
      reward: {name: remote, options: {url: "http://127.0.0.1:8000/score", batch_size: 32, concurrency: 4}}

It is a batched (TRL-style) reward: one call scores a rollout batch as ceil(n / batch_size) POST requests, up to
`concurrency` of them in flight. `examples/reward_server.py` is a reference service.

The JSON contract:

- request: ``POST url`` with ``Content-Type: application/json`` (and ``Authorization: Bearer <token>``, the
  stripped contents of `api_key_file`, when it is set), the body
  ``{"samples": [{"prompt": str, "response": str, "answer": str | null, "metadata": {...}}, ...]}``: the prompt as the
  model saw it (chat template applied), the decoded response, the reference answer (`data.answer_key`; null when
  the rows have none) and the row's other columns (chat data adds its messages as "prompt_messages"; numpy values
  become lists and numbers, other objects strings).
- reply: HTTP 200 with ``{"rewards": [number, ...]}``, one per sample, in order.

Failures. HTTP 5xx and 429, connection errors and timeouts are retried `retries` times, after `backoff_s`, then
twice that, ... (at most 30 s). Any other 4xx is not retried: it is a bad request or a wrong key, and the call
raises `RemoteRewardError` naming the status and the body's first 200 characters (every sample of the batch fails).
A request that still fails after its retries fails its samples, and the batch's requests not yet sent are not sent
(their samples fail too: the service is down); a reply of the wrong length or not in the contract's shape fails its
request's samples, an entry that is not a number fails its sample. Failed samples score 0 and count toward
`data.reward_failure_limit` as every reward failure does.

Time. `remote` runs in the calling thread and bounds its own time, so `data.reward_timeout_s` (one call's limit,
and one call here is a whole batch) does not apply to it. Each attempt of a request waits at most `timeout_s` to
connect and for each read of the reply; once a request has used its `retries + 1` attempts the batch stops sending,
so a dead or hung service fails a batch in about (retries + 1) x timeout_s + the backoffs (195.5 s by default).
"""

from __future__ import annotations

import http.client
import json
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rl.rollout.rewards.user_functions import Failure, checked_value

MAX_BACKOFF_S = 30.0
RETRIED_4XX = (429,)  # Too Many Requests: the service asks to be called later
DEFAULTS: dict[str, Any] = {
    "batch_size": 32,
    "concurrency": 4,
    "retries": 5,
    "backoff_s": 0.5,
    "timeout_s": 30.0,
    "api_key_file": None,
}
_URL_FIX = "set options.url of the remote reward to the service's address, e.g. url: http://127.0.0.1:8000/score"


class RemoteRewardError(RuntimeError):
    """The reward service refused a request with a 4xx status: a bug of the request or the setup, not retried."""


@dataclass(frozen=True)
class _Settings:
    url: str
    batch_size: int
    concurrency: int
    retries: int
    backoff_s: float
    timeout_s: float
    api_key_file: str | None

    def backoff(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (0-based): backoff_s doubling, capped."""
        return min(self.backoff_s * 2**retry, MAX_BACKOFF_S)


def remote(
    prompts: list,
    completions: list,
    prompt_texts: list,
    completion_ids: list | None = None,
    answer: list | None = None,
    *,
    url: str | None = None,
    batch_size: int = 32,
    concurrency: int = 4,
    retries: int = 5,
    backoff_s: float = 0.5,
    timeout_s: float = 30.0,
    api_key_file: str | None = None,
    **columns: list,
) -> list[float | Failure]:
    """Scores from a reward service over HTTP: the samples POSTed as JSON to options.url in batches, with retries.

    The arguments are TRL's (`user_functions`); `columns` are the rows' other columns. A value per sample, or a
    `Failure` for a sample whose request failed (see the module docstring for the contract and the failures)."""
    settings = _settings(
        {
            "url": url,
            "batch_size": batch_size,
            "concurrency": concurrency,
            "retries": retries,
            "backoff_s": backoff_s,
            "timeout_s": timeout_s,
            "api_key_file": api_key_file,
        }
    )
    samples = _request_samples(prompts, completions, prompt_texts, answer, columns)
    if not samples:
        return []
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if settings.api_key_file is not None:
        headers["Authorization"] = f"Bearer {_read_token(settings.api_key_file)}"
    size = settings.batch_size
    chunks = [samples[i : i + size] for i in range(0, len(samples), size)]
    stop = threading.Event()  # set when a request used all its attempts (or was refused): send no more
    results: list[list[float | Failure]] = [[] for _ in chunks]
    workers = min(settings.concurrency, len(chunks))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="remote-reward") as pool:
        futures: dict[Future, int] = {
            pool.submit(_post, settings, headers, chunk, stop): k for k, chunk in enumerate(chunks)
        }
        try:
            for future in as_completed(futures):
                results[futures[future]] = future.result()
        except BaseException:  # a refused request (4xx) or an interrupt: stop the rest, then raise
            stop.set()
            for future in futures:
                future.cancel()
            raise
    return [value for chunk_values in results for value in chunk_values]


def validate_options(options: Mapping[str, Any]) -> None:
    """A one-line ValueError naming a missing, unknown or ill-formed option of `remote` and its fix."""
    _settings(options)


remote.validate_options = validate_options  # type: ignore[attr-defined]


def _settings(options: Mapping[str, Any]) -> _Settings:
    unknown = sorted(set(options) - {"url", *DEFAULTS})
    if unknown:
        raise ValueError(f"unknown options {unknown}: remote takes url, {', '.join(DEFAULTS)}")
    url = options.get("url")
    if url is None:
        raise ValueError(f"options.url is missing: {_URL_FIX}")
    problem = _url_problem(url)
    if problem:
        raise ValueError(f"options.url={url!r} {problem}: {_URL_FIX}")
    values = {**DEFAULTS, **{k: v for k, v in options.items() if k != "url"}}
    for name, lowest in (("batch_size", 1), ("concurrency", 1), ("retries", 0)):
        value = values[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
            raise ValueError(f"options.{name}={value!r}: set a whole number >= {lowest} (default {DEFAULTS[name]})")
    for name, positive in (("timeout_s", True), ("backoff_s", False)):
        value = values[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (positive and value == 0):
            bound = "> 0" if positive else ">= 0"
            raise ValueError(f"options.{name}={value!r}: set a number of seconds {bound} (default {DEFAULTS[name]})")
    key_file = values["api_key_file"]
    if key_file is not None and not (isinstance(key_file, str) and Path(key_file).is_file()):
        raise ValueError(
            f"options.api_key_file={key_file!r} is not a file: name a file holding the bearer token, or drop the option"
        )
    return _Settings(
        url=url,
        batch_size=values["batch_size"],
        concurrency=values["concurrency"],
        retries=values["retries"],
        backoff_s=float(values["backoff_s"]),
        timeout_s=float(values["timeout_s"]),
        api_key_file=key_file,
    )


def _url_problem(url: object) -> str | None:
    """Why `url` is not an http(s) URL with a host, or None."""
    if not isinstance(url, str) or not url or any(c.isspace() for c in url):
        return "is not a URL"
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return "is not an http:// or https:// URL"
    if not parts.hostname:
        return "has no host"
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number in 0..65535
    except ValueError:
        return "has an invalid port"
    return None


def _read_token(path: str) -> str:
    """The bearer token in `path` (read on every call: a rotated key is picked up); never shown in a message."""
    token = Path(path).read_text(encoding="utf-8").strip()
    if not token or any(c.isspace() for c in token):
        raise ValueError(f"options.api_key_file={path!r} must hold one token (it is empty or has several words)")
    return token


def _request_samples(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    prompt_texts: Sequence[Any],
    answer: Sequence[Any] | None,
    columns: Mapping[str, Sequence[Any]],
) -> list[dict[str, Any]]:
    """The contract's sample objects: a chat completion `[{"role": "assistant", "content": text}]` gives its text."""
    samples = []
    for i, completion in enumerate(completions):
        response = completion[-1]["content"] if isinstance(completion, list) else completion
        metadata = {name: values[i] for name, values in columns.items()}
        if isinstance(prompts[i], list):
            metadata["prompt_messages"] = prompts[i]
        prompt = prompt_texts[i] if isinstance(prompt_texts[i], str) else ""
        samples.append({"prompt": prompt, "response": response, "answer": answer[i] if answer else None,
                        "metadata": metadata})  # fmt: skip
    return samples


def _jsonable(value: Any) -> Any:
    """json.dumps's fallback: numpy arrays and scalars as lists and numbers, bytes as text, anything else as str."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _post(
    settings: _Settings, headers: Mapping[str, str], chunk: list[dict[str, Any]], stop: threading.Event
) -> list[float | Failure]:
    """One request's rewards, retried as the module docstring says; RemoteRewardError on a 4xx."""
    n = len(chunk)
    body = json.dumps({"samples": chunk}, default=_jsonable).encode("utf-8")
    request = urllib.request.Request(settings.url, data=body, headers=dict(headers), method="POST")
    last = Failure("not sent")
    for attempt in range(settings.retries + 1):
        if stop.is_set() or (attempt and stop.wait(settings.backoff(attempt - 1))):
            why = "not sent" if attempt == 0 else f"not retried after {attempt} attempts (the last: {last.message})"
            return [Failure(f"{why}: another request of the batch failed after all its retries")] * n
        try:
            with urllib.request.urlopen(request, timeout=settings.timeout_s) as reply:
                raw = reply.read()
        except urllib.error.HTTPError as err:
            detail = _first_chars(err)
            if err.code < 500 and err.code not in RETRIED_4XX:
                stop.set()
                hint = " (check options.api_key_file)" if err.code in (401, 403) else ""
                raise RemoteRewardError(
                    f"HTTP {err.code} {err.reason} from {settings.url}: {detail!r}; a 4xx is not retried: fix the "
                    f"request{hint}"
                ) from None
            last = Failure(f"HTTP {err.code} {err.reason}: {detail!r}")
            continue
        except (urllib.error.URLError, http.client.HTTPException, OSError) as err:
            cause = err.reason if isinstance(err, urllib.error.URLError) else err
            if isinstance(cause, TimeoutError):
                last = Failure(f"timed out after {settings.timeout_s:g} s (options.timeout_s)", timed_out=True)
            else:
                last = Failure(f"connection failed: {type(cause).__name__}: {cause}")
            continue
        return _rewards(raw, n)
    stop.set()
    attempts = settings.retries + 1
    tries = f" {attempts} times; the last" if attempts > 1 else ""
    message = f"POST {settings.url} failed{tries}: {last.message}"
    return [Failure(message, timed_out=last.timed_out)] * n


def _first_chars(err: urllib.error.HTTPError, limit: int = 200) -> str:
    """The first `limit` characters of an error reply's body ('' when it cannot be read)."""
    try:
        return err.read(4 * limit).decode("utf-8", errors="replace")[:limit]
    except (OSError, http.client.HTTPException):
        return ""


def _rewards(raw: bytes, n: int) -> list[float | Failure]:
    """The reply's rewards, checked against the contract: a Failure per sample it does not give a number for."""
    try:
        reply = json.loads(raw)
    except ValueError:
        reply = None
    rewards = reply.get("rewards") if isinstance(reply, dict) else None
    if not isinstance(rewards, list):
        shown = raw[:200].decode("utf-8", errors="replace")
        return [Failure(f'the reply is not {{"rewards": [number, ...]}}: {shown!r}')] * n
    if len(rewards) != n:
        return [Failure(f"the reply has {len(rewards)} rewards for the request's {n} samples")] * n
    values: list[float | Failure] = []
    for j, value in enumerate(rewards):
        checked = Failure("true/false is not a number") if isinstance(value, bool) else checked_value(value)
        if isinstance(checked, Failure):
            checked = Failure(f"the reply's rewards[{j}]: {checked.message}")
        values.append(checked)
    return values
