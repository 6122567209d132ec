"""Kernel isolation of code tools: the bubblewrap command line and the seccomp filter it loads.

`bwrap_command` wraps a command in new user, pid, network, mount, ipc, uts and cgroup namespaces
(`bwrap --unshare-all`): the child sees only read-only binds of the interpreter, its standard library and the
shared libraries they link (site-packages hidden), a fresh read-only `/proc` of its own pid namespace, a minimal
read-only `/dev`, and one writable place, a size-limited tmpfs at `WORKDIR`. It runs as uid 65534 with no
capabilities, in a new session, with a network namespace that has only its own loopback, and dies with its parent
(`--die-with-parent`; the pid namespace takes every process it started with it). The seccomp filter refuses
(EPERM) process creation (threads stay allowed), ptrace and process_vm_*, mounts, namespaces, kernel keyrings,
bpf, perf, io_uring, userfaultfd, handle-based opens, modules, kexec and clock setting.

`probe` runs the real sandbox once per (bubblewrap, interpreter, user) and raises `IsolationUnavailable` with the reason
when it does not work (missing binary, no user namespaces, ...).
"""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

WORKDIR = "/work"  # the child's working directory and only writable place
SANDBOX_UID = 65534  # "nobody" inside the user namespace
INSTALL_HINT = "apt-get install bubblewrap"

# Refused with EPERM. Killing is not here: in its own pid namespace the child can signal only its own processes.
REFUSED_SYSCALLS = (
    "fork vfork ptrace process_vm_readv process_vm_writev process_madvise pidfd_getfd kcmp "
    "mount umount2 pivot_root chroot move_mount open_tree fsopen fsconfig fsmount fspick mount_setattr "
    "unshare setns keyctl add_key request_key bpf perf_event_open userfaultfd "
    "io_uring_setup io_uring_enter io_uring_register name_to_handle_at open_by_handle_at "
    "kexec_load kexec_file_load init_module finit_module delete_module reboot swapon swapoff acct quotactl "
    "lookup_dcookie syslog vhangup settimeofday clock_settime clock_adjtime adjtimex fanotify_init"
).split()
CLONE_THREAD = 0x00010000

_QUERY = (
    "import json, os, sys, sysconfig; p = sysconfig.get_paths(); "
    "print(json.dumps([os.path.realpath(sys.executable), p['stdlib'], p['platstdlib'], p['purelib'], p['platlib']]))"
)


class IsolationUnavailable(ValueError):
    """No working kernel isolation where the tool runs (the message names the fix)."""


@dataclass(frozen=True)
class InterpreterView:
    """The host paths the child sees, each bound read-only at the same place."""

    executable: str  # the interpreter's real path (a venv's python resolves to its base installation)
    read_only: tuple[str, ...]  # the interpreter, its standard library, the shared libraries they link
    hidden: tuple[str, ...]  # site-packages folders inside the standard library, covered by an empty tmpfs


@functools.cache
def interpreter_view(interpreter: str) -> InterpreterView:
    """What `interpreter` needs to run its standard library: found once by asking it and `ldd`."""
    executable, stdlib, platstdlib, purelib, platlib = json.loads(
        subprocess.run([interpreter, "-I", "-S", "-c", _QUERY], capture_output=True, check=True, text=True).stdout
    )
    libraries = {os.path.realpath(p) for p in (stdlib, platstdlib)}
    extensions = sorted(str(p) for root in libraries for p in Path(root, "lib-dynload").glob("*.so"))
    linked = subprocess.run(["ldd", executable, *extensions], capture_output=True, text=True).stdout
    shared = {line.split("=>")[1].split("(")[0].strip() for line in linked.splitlines() if "=> /" in line}
    shared |= {line.split("(")[0].strip() for line in linked.splitlines() if line.strip().startswith("/")}
    hidden = {os.path.realpath(p) for p in (purelib, platlib)}
    hidden = {h for h in hidden if any(h.startswith(root + os.sep) for root in libraries) and os.path.isdir(h)}
    paths = sorted({executable, *libraries, *(p for p in shared if p and not p.endswith(":"))})
    return InterpreterView(executable, tuple(paths), tuple(sorted(hidden)))


@functools.cache
def seccomp_program() -> bytes:
    """The BPF program bubblewrap loads before it executes the command (`--seccomp FD`), built with libseccomp."""
    import pyseccomp as seccomp

    refuse = seccomp.ERRNO(errno.EPERM)
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    for name in REFUSED_SYSCALLS:
        rules.add_rule(refuse, name)
    rules.add_rule(refuse, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_THREAD, 0))  # a process, not a thread
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")  # flags sit behind a pointer: glibc falls back to clone
    with tempfile.TemporaryFile() as out:
        rules.export_bpf(out)
        out.seek(0)
        return out.read()


@contextmanager
def bwrap_command(
    bwrap: str, view: InterpreterView, command: Sequence[str], *, disk_bytes: int, files: dict[str, str] | None = None
) -> Iterator[tuple[list[str], int]]:
    """`(argv, fd)`: `command` run under `bwrap` with `view`, `files` (host path -> sandbox path, read-only) and a
    `disk_bytes` tmpfs at WORKDIR; pass `fd` (the seccomp program, closed on exit) to the child (`pass_fds`)."""
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    argv += ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox", "--clearenv"]
    argv += ["--setenv", "LANG", "C.UTF-8"]
    for path in view.read_only:
        argv += ["--ro-bind", path, path]
    for path in view.hidden:
        argv += ["--tmpfs", path, "--remount-ro", path]
    for host, inside in (files or {}).items():
        argv += ["--ro-bind", host, inside]
    argv += ["--proc", "/proc", "--dev", "/dev", "--perms", "01777", "--size", str(disk_bytes), "--tmpfs", WORKDIR]
    argv += ["--remount-ro", "/", "--remount-ro", "/dev", "--remount-ro", "/proc", "--chdir", WORKDIR]
    fd = os.memfd_create("megatron-rl-seccomp")
    try:
        os.write(fd, seccomp_program())
        os.lseek(fd, 0, os.SEEK_SET)
        yield [*argv, "--seccomp", str(fd), "--", *command], fd
    finally:
        os.close(fd)


@functools.cache
def probe(bwrap: str, interpreter: str, user: int | None = None) -> InterpreterView:
    """The view of `interpreter` once a sandboxed `print` ran under `bwrap` started as `user` (None: this process's;
    cached per triple); else `IsolationUnavailable` naming what failed and the fix."""
    found = shutil.which(bwrap)

    def unavailable(reason: str) -> IsolationUnavailable:
        return IsolationUnavailable(
            f"python tool: no kernel isolation ({reason}); install bubblewrap where the trainer runs "
            f"(Debian/Ubuntu: {INSTALL_HINT}), or set rollout.env_options.tool_options.python.isolation: none to "
            "run model-written code with only rlimits and an audit hook (not a sandbox)"
        )

    if found is None:
        raise unavailable(f"{bwrap!r} not found")
    try:
        import pyseccomp  # noqa: F401
    except (ImportError, RuntimeError) as err:  # RuntimeError: pyseccomp found no libseccomp.so
        raise unavailable(f"the seccomp filter cannot be built: {err}") from err
    try:
        view = interpreter_view(interpreter)
    except (OSError, subprocess.CalledProcessError, ValueError) as err:
        raise unavailable(f"cannot inspect the interpreter {interpreter!r}: {err}") from err
    with bwrap_command(found, view, [view.executable, "-I", "-S", "-c", "print('ok')"], disk_bytes=1 << 20) as (
        argv,
        fd,
    ):
        try:
            result = subprocess.run(
                argv, pass_fds=(fd,), capture_output=True, text=True, timeout=60, user=user, group=user
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            raise unavailable(f"{found} could not run: {err}") from err
    if result.returncode != 0 or result.stdout != "ok\n":
        detail = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
        raise unavailable(f"{found} could not start a sandbox: {detail}")
    return view
