"""A Python code-execution tool: the code runs in a fresh, limited subprocess and its output is the answer.

The code is the model's, so it is adversarial. Layers, outermost first (docs/security.md has what each stops):

  * kernel isolation (`isolation`, default "auto": bubblewrap, probed at start-up; the tool refuses to start
    without it unless `isolation: none`): new user/pid/network/mount/ipc/uts namespaces, a read-only view of the
    interpreter and its standard library only, a `disk_mb` tmpfs as the only writable place, no capabilities, a
    seccomp filter (`isolation.py`);
  * wall-clock `timeout_s`: the parent kills the child's whole process group (and so bubblewrap's pid namespace);
  * rlimits set by the child before the code runs (hard = soft): RLIMIT_CPU `cpu_s` (SIGXCPU, SIGKILL a second
    later), RLIMIT_AS `memory_mb`, RLIMIT_FSIZE `file_mb` per file (stdout/stderr are files too), RLIMIT_CORE 0,
    RLIMIT_NOFILE 64, RLIMIT_NPROC 0 (not applied to root; under bubblewrap seccomp refuses new processes anyway);
  * an empty environment, `python -I -S` (standard library only);
  * an audit hook (`sandbox_child.py`, PEP 578), a tripwire that reports refusals clearly, not a boundary.

`isolation: none` keeps the last three layers and a host temporary directory as the working directory; every
rollout step then logs a warning (`warning`).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from megatron_rl.rollout.agent.tools import isolation as kernel
from megatron_rl.rollout.agent.tools.base import register_tool, string_argument

logger = logging.getLogger(__name__)

CHILD = Path(__file__).with_name("sandbox_child.py")
CHILD_INSIDE = "/sandbox/child.py"  # where the bubblewrap sandbox sees it
ISOLATIONS = ("auto", "bwrap", "none")  # auto: the best available kernel isolation (today bubblewrap)
UNISOLATED = (
    "python tool: isolation: none - model-written code runs WITHOUT kernel isolation (only rlimits and an audit "
    "hook, which can be bypassed); install bubblewrap and use isolation: auto"
)


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
        disk_mb: int = 64,
        output_chars: int = 2000,
        user: int | None = None,
        interpreter: str = sys.executable,
        isolation: str = "auto",
        bwrap: str = "bwrap",
    ):
        """`isolation`: auto | bwrap (both need a working bubblewrap, checked here) | none; `bwrap`: its name on PATH
        or path; `disk_mb`: the size of the sandbox's writable tmpfs; `user`: start the child (bubblewrap, or with
        `isolation: none` the interpreter) as this uid and gid, e.g. 65534; `interpreter`: the Python (3.10+) to run,
        which `user` must be able to execute (a root-only pyenv under /root is not; /usr/bin/python3 usually is)."""
        if isolation not in ISOLATIONS:
            raise ValueError(f"python tool: isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}")
        self.timeout_s, self.cpu_s, self.output_chars, self.user = timeout_s, cpu_s, output_chars, user
        self.interpreter = interpreter
        self.memory_bytes, self.file_bytes, self.disk_bytes = memory_mb << 20, file_mb << 20, disk_mb << 20
        self.view = None if isolation == "none" else kernel.probe(bwrap, interpreter, user)  # IsolationUnavailable
        self.bwrap = shutil.which(bwrap) or bwrap
        self.warning = UNISOLATED if self.view is None else None  # logged every rollout step

    def run(self, code: str) -> SandboxResult:
        with self._command() as (argv, cwd, fds), tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                cwd=cwd,
                env={"LANG": "C.UTF-8"},
                start_new_session=True,
                pass_fds=fds,
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
                _kill_group(proc.pid)  # the child and anything it left behind (bubblewrap: its pid namespace)
                proc.wait()
            status = proc.returncode
            if self.view is not None and status > 128:  # bubblewrap exits with 128 + N for a child killed by N
                status = 128 - status
            return SandboxResult(self._read(out), self._read(err), status, timed_out)

    @contextmanager
    def _command(self) -> Iterator[tuple[list[str], str | None, tuple[int, ...]]]:
        """`(argv, cwd, fds to pass)` of one call's child."""
        limits = [str(self.cpu_s), str(self.memory_bytes), str(self.file_bytes)]
        if self.view is not None:
            command = [self.view.executable, "-I", "-S", CHILD_INSIDE, kernel.WORKDIR, *limits]
            files = {str(CHILD): CHILD_INSIDE}
            with kernel.bwrap_command(self.bwrap, self.view, command, disk_bytes=self.disk_bytes, files=files) as (
                argv,
                fd,
            ):
                yield argv, None, (fd,)
            return
        with tempfile.TemporaryDirectory(prefix="megatron-rl-sandbox-") as root:
            workdir = Path(root, "work")
            workdir.mkdir()
            if self.user is not None:
                os.chmod(root, 0o711)  # the user may pass through to its working directory, not list the rest
                os.chown(workdir, self.user, self.user)
            yield [self.interpreter, "-I", "-S", str(CHILD), str(workdir), *limits], str(workdir), ()

    def _read(self, file: IO[bytes]) -> str:
        file.seek(0)
        data = file.read(self.output_chars + 1).decode("utf-8", "replace")
        return data if len(data) <= self.output_chars else data[: self.output_chars] + "... [truncated]"

    def __call__(self, arguments: Mapping[str, Any]) -> str:
        code = string_argument(arguments, "code")
        if code is None:
            return 'error: python needs "code" as a string'
        try:
            code.encode()
        except UnicodeEncodeError as err:  # a lone surrogate, e.g. from a JSON "\ud800" escape
            return f"error: the code is not valid Unicode ({err.reason}: {code[err.start]!r} at position {err.start})"
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


def signal_name(number: int) -> str:
    """SIGKILL, SIGRTMIN+1, ... or "signal 99" (`signal.Signals` has no real-time signals but SIGRTMIN/MAX)."""
    try:
        return signal.Signals(number).name
    except ValueError:
        if signal.SIGRTMIN < number < signal.SIGRTMAX:
            return f"SIGRTMIN+{number - signal.SIGRTMIN}"
        return f"signal {number}"


def describe(result: SandboxResult, timeout_s: float) -> str:
    """The observation: stdout, then stderr, then why it ended when it was not a clean exit."""
    parts = [result.stdout.rstrip("\n")] if result.stdout else []
    if result.stderr:
        parts.append("stderr:\n" + result.stderr.rstrip("\n"))
    if result.timed_out:
        parts.append(f"error: timed out after {timeout_s:g} s (killed)")
    elif result.exit_code < 0:
        name = signal_name(-result.exit_code)
        parts.append(f"error: killed by {name}" + {"SIGXCPU": " (CPU time limit)"}.get(name, ""))
    elif result.exit_code != 0:
        parts.append(f"exit status {result.exit_code}")
    return "\n".join(parts)
