"""The control plane's API key without SGLang: the 0600 key file, a launch whose command line (what `ps` shows)
holds no key, redacted logs, and a weight-sync store that listens on one address only (runs everywhere).

A stand-in `sglang.launch_server` (written below, put on the servers' PYTHONPATH) checks `--api-key` the way
SGLang 0.5.23 does (`srt/utils/auth.py`: `Authorization: Bearer <key>` on every path but /health*, 401 otherwise)
and logs its arguments, key included, as SGLang does."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_rl.rollout.sglang.api_key import (
    client_api_key,
    create_api_key_file,
    launch_api_key_file,
    read_api_key_file,
)
from megatron_rl.rollout.sglang.sglang_engine import SGLangEngine
from megatron_rl.rollout.sglang.sglang_server import SGLangLaunchConfig, SGLangServerError, SGLangServers, request_json

FAKE_SERVER = """
import json, logging, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]


def value(flag):  # argparse's two spellings: `--flag VALUE` and `--flag=VALUE`
    joined = [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]
    return joined[-1] if joined else args[args.index(flag) + 1]


key = value("--api-key")
logging.basicConfig(level=logging.INFO, force=True)
logging.getLogger("fake_sglang").info("server_args=%s", {"api_key": key, "port": int(value("--port"))})


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _answer(self):
        if self.headers.get("Content-Length"):
            self.rfile.read(int(self.headers["Content-Length"]))
        ok = self.path.startswith("/health") or self.headers.get("Authorization") == f"Bearer {key}"
        raw = json.dumps({"weight_version": "default", "model_path": "/m"} if ok else {"error": "Unauthorized"})
        self.send_response(200 if ok else 401)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw.encode())

    do_GET = do_POST = _answer


ThreadingHTTPServer((value("--host"), int(value("--port"))), Handler).serve_forever()
"""


def test_key_file_is_private_and_fresh(tmp_path: Path) -> None:
    old = os.umask(0)  # even with a permissive umask
    try:
        key = create_api_key_file(tmp_path / "run" / ".rollout_api_key")
        again = create_api_key_file(tmp_path / "run" / ".rollout_api_key")
    finally:
        os.umask(old)
    path = tmp_path / "run" / ".rollout_api_key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(key) >= 40 and key != again and read_api_key_file(path) == again
    assert [p.name for p in path.parent.iterdir()] == [".rollout_api_key"]  # no temporary file left
    path.chmod(0o644)
    with pytest.raises(ValueError, match="accessible to other users.*chmod 600"):
        read_api_key_file(path)


def test_where_the_key_comes_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = launch_api_key_file(None, tmp_path)  # null: a fresh key per run in the output folder
    key1 = read_api_key_file(first)
    assert first == tmp_path / ".rollout_api_key" and read_api_key_file(launch_api_key_file(None, tmp_path)) != key1
    mine = tmp_path / "my.key"
    assert read_api_key_file(launch_api_key_file(str(mine), tmp_path)) == read_api_key_file(mine)  # created
    kept = read_api_key_file(mine)
    assert read_api_key_file(launch_api_key_file(str(mine), tmp_path)) == kept  # an existing file is used
    assert client_api_key(str(mine), None) == kept
    monkeypatch.setenv("SGL_KEY", "from-env")
    assert client_api_key(str(mine), "SGL_KEY") == "from-env"
    monkeypatch.delenv("SGL_KEY")
    with pytest.raises(ValueError, match="SGL_KEY is not set"):
        client_api_key(None, "SGL_KEY")
    assert client_api_key(None, None) is None


@pytest.fixture
def fake_sglang(tmp_path: Path) -> Path:
    package = tmp_path / "fake" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(textwrap.dedent(FAKE_SERVER))
    return package.parent


def test_launched_server_gets_the_key_but_no_command_line_shows_it(fake_sglang: Path, tmp_path: Path) -> None:
    config = SGLangLaunchConfig(
        model_path="/m", python=sys.executable, env={"PYTHONPATH": str(fake_sglang)}, log_dir=str(tmp_path / "logs"),
        startup_timeout_s=60,
    )  # fmt: skip
    with SGLangServers.launch(config) as servers:
        key, url = servers.api_key, servers.urls[0]
        assert servers.api_key_file == tmp_path / "logs" / ".rollout_api_key"
        assert stat.S_IMODE(servers.api_key_file.stat().st_mode) == 0o600
        cmdline = Path(f"/proc/{servers._procs[0].pid}/cmdline").read_bytes().decode()
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert key not in cmdline and key not in ps
        assert "sglang.launch_server" in cmdline and str(servers.api_key_file) in cmdline
        assert request_json(url, "/model_info", timeout_s=10, api_key=key)["weight_version"] == "default"
        for wrong in (None, "not-the-key"):
            with pytest.raises(SGLangServerError, match="HTTP 401"):
                request_json(url, "/generate", {"input_ids": [1]}, timeout_s=10, api_key=wrong)
        assert SGLangEngine(servers).weight_version == "default"  # the engine sends the servers' key
        assert SGLangEngine([url], api_key=key).healthy()
    log = next((tmp_path / "logs").glob("sglang_0_*.log"))
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    text = log.read_text()
    assert key not in text and "'api_key': '<redacted>'" in text  # the launcher redacts SGLang's own log line


def _non_loopback_ipv4() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: only picks the outgoing interface
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_weight_sync_store_listens_on_the_trainer_address_only() -> None:
    """The broadcast group's store listens on `master_address`, not on every interface as TCPStore alone."""
    import torch.distributed as dist

    from megatron_rl.rollout.sglang.broadcast_store import GuardedStore
    from megatron_rl.rollout.sglang.distributed_weight_sync import _listen, _new_process_group

    other = _non_loopback_ipv4()
    if other is None:
        pytest.skip("no non-loopback IPv4 address to probe")
    listener = _listen("127.0.0.1", 0)
    port = listener.getsockname()[1]
    store = GuardedStore(listener, "megatron_rl_weight_update_test")
    group = _new_process_group("gloo", "127.0.0.1", port, 1, "megatron_rl_weight_update_test", 30)
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        with pytest.raises(OSError):
            socket.create_connection((other, port), timeout=5).close()
    finally:
        dist.destroy_process_group(group)
        store.close()


def test_generated_keys_never_look_like_options(tmp_path: Path) -> None:
    """A key passed as `--api-key KEY` must not start with "-" (argparse would take it for an option); the launch
    passes `--api-key=KEY` anyway."""
    keys = [create_api_key_file(tmp_path / f"k{i}") for i in range(400)]  # ~6 would start with "-" unchecked
    assert not any(k.startswith("-") for k in keys) and len(set(keys)) == 400
