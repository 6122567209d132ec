"""A Python code-execution tool: the code runs in a fresh, limited subprocess and its output is the answer.

What enforces what (be honest about it before pointing it at untrusted models):

Kernel-enforced (the code cannot lift them):
  * wall-clock `timeout_s`: the parent kills the child's whole process group (it runs in its own session);
  * RLIMIT_CPU `cpu_s` (killed at the limit), RLIMIT_AS `memory_mb` (allocations fail with MemoryError),
    RLIMIT_FSIZE `file_mb` per file written (its stdout/stderr are files too, so output is bounded),
    RLIMIT_CORE 0, RLIMIT_NOFILE 64, hard limits (CPU: SIGXCPU at `cpu_s`, SIGKILL one second later);
  * RLIMIT_NPROC 0: no fork and no thread, but Linux does not apply it to root; pass `user` (e.g. 65534,
    "nobody") to run the child as an unprivileged user when the trainer runs as root (`interpreter` and this
    package must then be readable by that user), which also makes file permissions apply;
  * a fresh temporary working directory, deleted afterwards; an empty environment; `python -I -S` (no user site,
    no site-packages, no PYTHON* variables, no script directory on sys.path): the standard library only.

Enforced only by an audit hook in the child (`sandbox_child.py`, PEP 578): refusing sockets and the `socket`,
`ssl`, `ctypes`, `subprocess`, `multiprocessing` modules, fork/exec/spawn/system/kill, writes (and renames,
deletes, links, chmod) outside the working directory, reads and listings outside it and the Python installation.
PEP 578 says hooks are not a sandbox: code in the same interpreter can get around them (by rebinding the
functions the hook calls, e.g. `os.path.realpath`'s helpers, or through an interpreter bug). There is no network
namespace and no seccomp filter: for adversarial code run the trainer's tool workers in a container or VM with
networking off (or wrap the command in `unshare -n` / bubblewrap).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rl.rollout.tools.base import register_tool, string_argument

logger = logging.getLogger(__name__)

CHILD = Path(__file__).with_name("sandbox_child.py")


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int  # negative: killed by that signal
    timed_out: bool


@register_tool("python")
class PythonSandbox:
    """Runs the "code" argument; answers with its stdout, then its stderr and how it ended when not cleanly."""

    name = "python"
    description = "Run Python code (standard library only, no network, no files outside the working directory)."
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the program; print what you want to see"}},
        "required": ["code"],
    }

    def __init__(
        self,
        *,
        timeout_s: float = 5.0,
        cpu_s: int = 5,
        memory_mb: int = 512,
        file_mb: int = 16,
        output_chars: int = 2000,
        user: int | None = None,
        interpreter: str = sys.executable,
    ):
        """`user`: run the child as this uid (and gid), e.g. 65534; `interpreter`: the Python (3.10+) to run, which
        `user` must be able to execute (a root-only pyenv under /root is not; /usr/bin/python3 usually is)."""
        self.timeout_s, self.cpu_s, self.output_chars, self.user = timeout_s, cpu_s, output_chars, user
        self.interpreter = interpreter
        self.memory_bytes, self.file_bytes = memory_mb << 20, file_mb << 20

    def run(self, code: str) -> SandboxResult:
        with tempfile.TemporaryDirectory(prefix="megatron-rl-sandbox-") as root:
            workdir = Path(root, "work")
            workdir.mkdir()
            if self.user is not None:
                os.chmod(root, 0o711)  # the user may pass through to its working directory, not list the rest
                os.chown(workdir, self.user, self.user)
            argv = [self.interpreter, "-I", "-S", str(CHILD), str(workdir), str(self.cpu_s)]
            argv += [str(self.memory_bytes), str(self.file_bytes)]
            with open(Path(root, "stdout"), "w+b") as out, open(Path(root, "stderr"), "w+b") as err:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=out,
                    stderr=err,
                    cwd=workdir,
                    env={"LANG": "C.UTF-8"},
                    start_new_session=True,
                    user=self.user,
                    group=self.user,
                    extra_groups=None if self.user is None else [],
                )
                timed_out = False
                try:
                    proc.communicate(code.encode(), timeout=self.timeout_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                finally:
                    _kill_group(proc.pid)  # the child and anything it left behind
                    proc.wait()
                return SandboxResult(self._read(out), self._read(err), proc.returncode, timed_out)

    def _read(self, file) -> str:
        file.seek(0)
        data = file.read(self.output_chars + 1).decode("utf-8", "replace")
        return data if len(data) <= self.output_chars else data[: self.output_chars] + "... [truncated]"

    def __call__(self, arguments: Mapping[str, Any]) -> str:
        code = string_argument(arguments, "code")
        if code is None:
            return 'error: python needs "code" as a string'
        try:
            return describe(self.run(code), self.timeout_s)
        except OSError as err:  # the interpreter could not be started (e.g. not readable by `user`)
            logger.warning("the Python sandbox could not run: %s", err)
            return f"error: the sandbox could not start ({type(err).__name__})"


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def describe(result: SandboxResult, timeout_s: float) -> str:
    """The observation: stdout, then stderr, then why it ended when it was not a clean exit."""
    parts = [result.stdout.rstrip("\n")] if result.stdout else []
    if result.stderr:
        parts.append("stderr:\n" + result.stderr.rstrip("\n"))
    if result.timed_out:
        parts.append(f"error: timed out after {timeout_s:g} s (killed)")
    elif result.exit_code < 0:
        name = signal.Signals(-result.exit_code).name
        parts.append(f"error: killed by {name}" + {"SIGXCPU": " (CPU time limit)"}.get(name, ""))
    elif result.exit_code != 0:
        parts.append(f"exit status {result.exit_code}")
    return "\n".join(parts)
