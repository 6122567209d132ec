"""Launching, health-checking and restarting SGLang servers, and the small HTTP client the SGLang code shares.

`SGLangServers.launch(...)` starts N `python -m sglang.launch_server` processes from a given Python (SGLang lives
in its own virtualenv: it pins other torch/transformers versions than the trainer), each in its own process
session (SGLang kills its whole process tree on a fatal error; a session keeps that away from the trainer), on
its own port, logging to its own file. `SGLangServers.connect(urls)` wraps servers started elsewhere.
With N > 1 and `router=True` an `sglang-router` (0.3.x, `POST /workers` registration) is put in front; it only
proxies /generate, so weight sync, abort and pause always go to every server directly.

Every launched server and router gets the run's API key (`api_key.py`): started through
`sglang_keyed_launch.py`, which reads it from a 0600 file inside the server process (never on a command line),
and every request made here sends it as `Authorization: Bearer <key>`. Their logs are created 0600.

Platform specifics (CPU shims, `--device cpu`) are not handled here: callers pass `extra_args` and `env`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.net import free_port
from megatron_rl.rollout.engine import RolloutEngineError
from megatron_rl.rollout.sglang.api_key import API_KEY_FILE_NAME, auth_headers, create_api_key_file, read_api_key_file

logger = logging.getLogger(__name__)

_HEALTH_POLL_S = 0.5
_KEYED_LAUNCH = Path(__file__).with_name("sglang_keyed_launch.py")


class SGLangServerError(RolloutEngineError):
    """An SGLang server is unreachable, timed out, crashed or refused a request."""


# ---------------------------------------------------------------------------------------------- HTTP client
def request_json(
    url: str, path: str, body: Any = None, *, timeout_s: float, method: str | None = None, api_key: str | None = None
) -> Any:
    """POST `body` as JSON (GET when `body` is None) to `url + path`; the decoded JSON answer (None if empty).

    `api_key`: sent as `Authorization: Bearer <key>` (the servers' `--api-key`); a wrong or missing key is HTTP 401.

    Raises `SGLangServerError` naming the server and endpoint: unreachable, no answer within `timeout_s`, or an
    HTTP error status (with the server's message).
    """
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url.rstrip("/") + path,
        data=data,
        method=method or ("GET" if body is None else "POST"),
        headers={**({"Content-Type": "application/json"} if data is not None else {}), **auth_headers(api_key)},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:2000]
        raise SGLangServerError(f"SGLang {url}{path} answered HTTP {err.code}: {detail}") from err
    except TimeoutError as err:
        raise SGLangServerError(f"SGLang {url}{path} did not answer within {timeout_s:g} s") from err
    except (urllib.error.URLError, ConnectionError, OSError) as err:
        reason = getattr(err, "reason", err)
        if isinstance(reason, TimeoutError | socket.timeout):
            raise SGLangServerError(f"SGLang {url}{path} did not answer within {timeout_s:g} s") from err
        raise SGLangServerError(f"SGLang server {url} is unreachable ({path}): {reason}") from err
    if not raw:
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw.decode(errors="replace")


def is_healthy(url: str, timeout_s: float = 5.0, api_key: str | None = None) -> bool:
    """True when `GET /health` answers 200 (SGLang runs a 1-token generation for it; it needs no key, but
    one is sent anyway, so a proxy that checks every path also passes)."""
    try:
        request_json(url, "/health", timeout_s=timeout_s, api_key=api_key)
        return True
    except SGLangServerError:
        return False


# ---------------------------------------------------------------------------------------------- servers
@dataclass
class SGLangLaunchConfig:
    """How to start SGLang servers (one per replica; each may use several GPUs via `extra_args` --tp-size)."""

    model_path: str = field(metadata={"help": "HF checkpoint directory served by every server"})
    python: str = field(metadata={"help": "Python executable of the SGLang virtualenv"})
    num_servers: int = field(default=1, metadata={"help": "independent server replicas"})
    host: str = field(default="127.0.0.1", metadata={"help": "interface the servers bind to"})
    ports: tuple[int, ...] = field(default=(), metadata={"help": "one port per server; empty = free ports"})
    extra_args: tuple[str, ...] = field(default=(), metadata={"help": "further `sglang.launch_server` flags"})
    env: dict[str, str] = field(default_factory=dict, metadata={"help": "environment overrides for the servers"})
    log_dir: str = field(default="sglang_logs", metadata={"help": "one log file per server (and the router)"})
    startup_timeout_s: float = field(default=300.0, metadata={"help": "seconds to wait for /health after launch"})
    router: bool = field(default=False, metadata={"help": "put sglang-router in front when num_servers > 1"})
    router_policy: str = field(default="round_robin", metadata={"help": "sglang-router load-balancing policy"})
    api_key_file: str = field(
        default="",
        metadata={
            "help": "0600 file with the servers' and router's API key: used when it exists, else created with a "
            f"fresh random key; empty = `log_dir`/{API_KEY_FILE_NAME}"
        },
    )


class SGLangServers:
    """A set of SGLang servers (launched here or connected to) and, optionally, a router in front."""

    def __init__(
        self,
        urls: list[str],
        *,
        config: SGLangLaunchConfig | None = None,
        router_url: str | None = None,
        api_key: str | None = None,
    ):
        self.urls = [u.rstrip("/") for u in urls]
        self.config = config
        self.router_url = router_url
        self.api_key = api_key  # sent with every request; never logged
        self.api_key_file: Path | None = None  # launched servers: where the key is (passed to them, not the key)
        self._procs: list[subprocess.Popen | None] = [None] * len(urls)
        self._router_proc: subprocess.Popen | None = None
        self._logs: list[Path | None] = [None] * len(urls)

    # ------------------------------------------------------------------ construction
    @classmethod
    def connect(cls, urls: list[str], *, router_url: str | None = None, api_key: str | None = None) -> SGLangServers:
        """Wrap servers started elsewhere (`stop()`/`restart()` are then unavailable); `api_key`: their key."""
        if not urls:
            raise ValueError("connect() needs at least one server URL")
        return cls(list(urls), router_url=router_url, api_key=api_key)

    @classmethod
    def launch(cls, config: SGLangLaunchConfig) -> SGLangServers:
        """Start `config.num_servers` servers (concurrently) and wait until every one is healthy."""
        if config.num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {config.num_servers}")
        if config.ports and len(config.ports) != config.num_servers:
            raise ValueError(f"{len(config.ports)} ports for {config.num_servers} servers")
        ports = list(config.ports) or [free_port(config.host) for _ in range(config.num_servers)]
        Path(config.log_dir).mkdir(parents=True, exist_ok=True)
        key_file = Path(config.api_key_file or Path(config.log_dir) / API_KEY_FILE_NAME)
        api_key = read_api_key_file(key_file) if key_file.exists() else create_api_key_file(key_file)
        servers = cls([f"http://{config.host}:{p}" for p in ports], config=config, api_key=api_key)
        servers.api_key_file = key_file
        try:
            for i in range(config.num_servers):
                servers._start(i)
            for i in range(config.num_servers):
                servers.wait_healthy(i, config.startup_timeout_s)
            if config.router and config.num_servers > 1:
                servers.start_router()
        except BaseException:
            servers.stop()
            raise
        return servers

    # ------------------------------------------------------------------ processes
    def _start(self, i: int) -> None:
        config = self._need_config("start")
        port = int(self.urls[i].rsplit(":", 1)[1])
        cmd = self._keyed_command(
            "sglang.launch_server",
            "--model-path",
            str(config.model_path),
            "--host",
            config.host,
            "--port",
            str(port),
            *config.extra_args,
        )
        log_path = Path(config.log_dir) / f"sglang_{i}_{port}.log"
        self._logs[i] = log_path
        env = {**os.environ, **config.env}
        with _private_log(log_path) as log:
            log.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(cmd)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
            self._procs[i] = proc
        logger.info("started SGLang server %d (pid %d) at %s, log %s", i, proc.pid, self.urls[i], log_path)

    def start_router(self) -> None:
        """Launch `sglang-router` (from the SGLang venv) and register every server with it."""
        config = self._need_config("start a router")
        if self._router_proc is not None:
            raise SGLangServerError(f"a router is already running at {self.router_url}")
        port = free_port(config.host)
        log_path = Path(config.log_dir) / f"sglang_router_{port}.log"
        cmd = self._keyed_command(
            "sglang_router.launch_router",
            *("--host", config.host, "--port", str(port), "--policy", config.router_policy),
            # its metrics exporter would listen on 0.0.0.0:29000 (no key there): keep it local, on a free port
            *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())),
        )  # its --api-key guards the router's endpoints and is sent to the workers
        with _private_log(log_path) as log:
            self._router_proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self.router_url = f"http://{config.host}:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                request_json(self.router_url, "/liveness", timeout_s=2, api_key=self.api_key)
                break
            except SGLangServerError:
                if self._router_proc.poll() is not None or time.monotonic() > deadline:
                    raise SGLangServerError(f"sglang-router did not start; see {log_path}") from None
                time.sleep(_HEALTH_POLL_S)
        for url in self.urls:
            self.register_with_router(url)

    def register_with_router(self, url: str, timeout_s: float = 60.0) -> None:
        """`POST /workers` (sglang-router 0.3.x; registration is asynchronous) and wait until it is listed."""
        if self.router_url is None:
            raise ValueError("no router")
        body = {"url": url, **({"api_key": self.api_key} if self.api_key else {})}  # the key the router sends it
        request_json(self.router_url, "/workers", body, timeout_s=10, api_key=self.api_key)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            listed = request_json(self.router_url, "/workers", timeout_s=10, api_key=self.api_key)
            workers = listed.get("workers", listed) if isinstance(listed, dict) else listed
            if any(isinstance(w, dict) and w.get("url", "").rstrip("/") == url for w in workers or []):
                return
            time.sleep(_HEALTH_POLL_S)
        raise SGLangServerError(f"sglang-router at {self.router_url} did not list worker {url} within {timeout_s} s")

    def wait_healthy(self, i: int, timeout_s: float) -> None:
        """Block until server `i` answers /health; fail early (with the log tail) when its process exits."""
        deadline = time.monotonic() + timeout_s
        while True:
            proc = self._procs[i]
            if proc is not None and proc.poll() is not None:
                raise SGLangServerError(
                    f"SGLang server {i} ({self.urls[i]}) exited with code {proc.returncode} during start-up; "
                    f"log tail:\n{self.log_tail(i)}"
                )
            if is_healthy(self.urls[i], timeout_s=10, api_key=self.api_key):
                return
            if time.monotonic() > deadline:
                raise SGLangServerError(
                    f"SGLang server {i} ({self.urls[i]}) not healthy after {timeout_s:g} s; log tail:\n"
                    f"{self.log_tail(i)}"
                )
            time.sleep(_HEALTH_POLL_S)

    def alive(self, i: int) -> bool:
        """Process still running (launched servers) or /health answering (connected ones)."""
        proc = self._procs[i]
        if proc is not None:
            return proc.poll() is None
        return is_healthy(self.urls[i], api_key=self.api_key)

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to server `i`'s whole process group (its scheduler and detokenizer too)."""
        proc = self._procs[i]
        if proc is None:
            raise ValueError(f"server {i} was not launched here")
        _kill_group(proc, sig)

    def restart(self, i: int, timeout_s: float | None = None) -> None:
        """Stop server `i` (if running), start it again on the same port, wait for health, re-register it."""
        config = self._need_config("restart")
        proc = self._procs[i]
        if proc is not None:
            _stop_process(proc)
        self._start(i)
        self.wait_healthy(i, timeout_s or config.startup_timeout_s)
        if self.router_url is not None and self._router_proc is not None:
            self.register_with_router(self.urls[i])

    def stop_router(self) -> None:
        if self._router_proc is not None:
            _stop_process(self._router_proc)
        self._router_proc, self.router_url = None, None

    def stop(self) -> None:
        """Terminate every launched server and the router (SIGTERM, then SIGKILL after 15 s)."""
        self.stop_router()
        for proc in self._procs:
            if proc is not None:
                _stop_process(proc)

    def log_tail(self, i: int, chars: int = 3000) -> str:
        path = self._logs[i]
        if path is None or not path.exists():
            return "(no log)"
        return path.read_text(errors="replace")[-chars:]

    def _keyed_command(self, module: str, *args: str) -> list[str]:
        """`python -m module args --api-key <key>`, with the key read from its file inside the new process."""
        config = self._need_config("start")
        assert self.api_key_file is not None
        return [config.python, "-P", str(_KEYED_LAUNCH), str(self.api_key_file), module, *args]

    def _need_config(self, what: str) -> SGLangLaunchConfig:
        if self.config is None:
            raise SGLangServerError(f"cannot {what}: these servers were connected to, not launched here")
        return self.config

    def __enter__(self) -> SGLangServers:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _private_log(path: Path):
    """`path` opened for appending, created 0600: SGLang logs name the weight-sync group (docs/security.md)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the process leads its own session/group (start_new_session=True)
    except ProcessLookupError:
        pass


def _stop_process(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    if proc.poll() is None:
        _kill_group(proc, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    _kill_group(proc, signal.SIGKILL)  # children that outlived the leader
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        logger.warning("SGLang process %d did not exit after SIGKILL", proc.pid)
