"""The rollout control plane's per-run secret: SGLang's API key, kept in a file only its owner can read.

Every SGLang server and router the project launches is started with `--api-key` (SGLang 0.5.23:
`srt/arg_groups/fields/serving.py`, checked by `srt/utils/auth.py` on every endpoint except /health*, /ready*
and /metrics*), and every client request sends `Authorization: Bearer <key>`. The key lives only in a mode-0600
file (and in the memory of the processes that use it): never in `config.yaml`, a log line, or a command line
that `ps` shows; `sglang_keyed_launch.py` hands it to the server inside the server's own process. See
docs/security.md for what this protects and what it does not.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

logger = logging.getLogger(__name__)

API_KEY_FILE_NAME = ".rollout_api_key"


def create_api_key_file(path: str | Path) -> str:
    """Write a fresh random key to `path` (mode 0600, replacing any older file atomically); return the key."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(32)
    while key.startswith("-"):  # one key in 64 would read as an option where a tool passes it as `--api-key KEY`
        key = secrets.token_urlsafe(32)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # 0600 from the first byte, whatever the umask
    try:
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return key


def read_api_key_file(path: str | Path) -> str:
    """The key in `path`; refuses a file that other users can read or write, or an empty one."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        key = path.read_text().strip()
    except FileNotFoundError:
        raise ValueError(f"API key file {path} does not exist") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(
            f"API key file {path} is accessible to other users (mode {stat.S_IMODE(mode):04o}): run chmod 600 {path}"
        )
    if not key:
        raise ValueError(f"API key file {path} is empty")
    return key


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The HTTP header SGLang checks (`Authorization: Bearer <key>`); none without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def launch_api_key_file(api_key_file: str | None, output_dir: str | Path) -> Path:
    """Where launched servers read their key: `api_key_file` (created with a fresh key when missing), or for
    None a fresh key per run in `output_dir`/.rollout_api_key."""
    if api_key_file is None:
        path = Path(output_dir) / API_KEY_FILE_NAME
        create_api_key_file(path)
        return path
    path = Path(api_key_file)
    if not path.exists():
        create_api_key_file(path)
    read_api_key_file(path)  # refuse a file others can read before any server uses it
    return path


def client_api_key(api_key_file: str | None, api_key_env: str | None) -> str | None:
    """The key of servers started elsewhere: from the environment variable named `api_key_env`, else from
    `api_key_file`, else None (servers without a key: a warning, their control endpoints are open)."""
    if api_key_env:
        key = os.environ.get(api_key_env, "").strip()
        if not key:
            raise ValueError(f"rollout.sglang.api_key_env={api_key_env} but ${api_key_env} is not set or empty")
        return key
    if api_key_file:
        return read_api_key_file(api_key_file)
    logger.warning(
        "rollout.sglang.urls without an API key: anyone who can reach these servers can load weights into them; "
        "start them with --api-key and set rollout.sglang.api_key_file or api_key_env (docs/security.md)"
    )
    return None
