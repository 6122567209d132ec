"""Start an SGLang server or router with its API key read from a file, so the key never shows in `ps`.

    python -P sglang_keyed_launch.py KEY_FILE MODULE [ARGS...]

runs `python -m MODULE ARGS... --api-key <key>` inside this process (`runpy`), so /proc/<pid>/cmdline holds only
the key file's path. SGLang 0.5.23 reads the key only from `--api-key` (no environment variable) and logs its
resolved arguments, key included (`srt/entrypoints/engine.py`: "server_args=..."): every log record of this
process has the key replaced by "<redacted>". SGLang's spawned scheduler processes get their arguments through
a pipe, not a command line.

Runs with the SGLang virtualenv's Python, which does not have megatron_rl installed: standard library only.
`-P` (or the path fix-up below) keeps this directory off `sys.path`, so none of its modules can shadow a
module SGLang imports.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys

REDACTED = "<redacted>"


def _drop_script_dir() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]


def _redact_logs(secret: str) -> None:
    """Replace `secret` in every log record this process creates (survives `basicConfig(force=True)`)."""
    make_record = logging.getLogRecordFactory()

    def factory(*args, **kwargs) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: leave it to logging's own error handling
            return record
        if secret in message:
            record.msg, record.args = message.replace(secret, REDACTED), ()
        return record

    logging.setLogRecordFactory(factory)


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: sglang_keyed_launch.py KEY_FILE MODULE [ARGS...]")
    key_file, module, args = argv[0], argv[1], argv[2:]
    with open(key_file) as f:
        key = f.read().strip()
    if not key:
        sys.exit(f"API key file {key_file} is empty")
    _drop_script_dir()
    _redact_logs(key)
    sys.argv = [module, *args, f"--api-key={key}"]  # one token: a key starting with "-" is not taken for an option
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
