"""The python tool's kernel isolation: every escape that got past the audit hook alone is refused or contained,
checked by its effect on the host (a file outside not written or deleted, a loopback listener not reached, this
process (standing in for the trainer) alive, not signalled and its secret unread, no process left, /dev/shm clean).

Two layers are tested apart: the shipped tool with its defaults (hook bypasses first, then the escape), and the
bubblewrap sandbox alone running code with no audit hook at all (ctypes allowed), which shows what the kernel
holds by itself. Needs bubblewrap: skipped without it, failed when CI=true (.ci/run installs it).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from megatron_rl.config.sampling import TurnLimits
from megatron_rl.rollout.agent.multi_turn import MultiTurnRollout
from megatron_rl.rollout.agent.tool_env import ToolEnv
from megatron_rl.rollout.agent.tools import isolation
from megatron_rl.rollout.agent.tools.python_sandbox import UNISOLATED, PythonSandbox

PREFIX = "megatron-rl-trainer-secret-"
SECRET = PREFIX + secrets.token_hex(16)  # lives in this process's memory, as the SGLang API key in the trainer's
MARKER = "megatron-rl-escape-" + secrets.token_hex(8)  # names every file and process an escape would leave


class Host:
    """What an escape would change on the host, and the checks that it did not."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.planted = folder / "planted.txt"
        self.planted.write_text("keep")
        self.stdlib_file = Path(sysconfig.get_paths()["stdlib"], MARKER + ".py")
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.signals: list[int] = []
        self.previous = signal.signal(signal.SIGUSR1, lambda number, frame: self.signals.append(number))

    def fill(self, code: str) -> str:
        values = {"HOST_DIR": str(self.folder), "PLANTED": str(self.planted), "STDLIB": str(self.stdlib_file.parent)}
        values |= {"HOST_PID": str(os.getpid()), "PORT": str(self.port), "MARKER": MARKER, "PREFIX": PREFIX}
        for key, value in values.items():
            code = code.replace(key, value)
        return code

    def assert_untouched(self, answer: str) -> None:
        assert sorted(p.name for p in self.folder.iterdir()) == ["planted.txt"], answer
        assert self.planted.read_text() == "keep"
        assert not self.stdlib_file.exists(), answer
        assert SECRET not in answer and SECRET[len(PREFIX) :] not in answer
        assert self.signals == [], "this process (the trainer) was signalled"
        with pytest.raises(BlockingIOError):  # nobody connected to the host's loopback listener
            self.listener.accept()
        assert not Path("/dev/shm", MARKER).exists()
        left = [p for p in Path("/proc").glob("[0-9]*") if MARKER.encode() in _cmdline(p)]
        assert left == [], "a process of the call is still running"

    def close(self) -> None:
        signal.signal(signal.SIGUSR1, self.previous)
        self.listener.close()
        self.stdlib_file.unlink(missing_ok=True)
        Path("/dev/shm", MARKER).unlink(missing_ok=True)


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


@pytest.fixture
def host(tmp_path: Path):
    h = Host(tmp_path)
    yield h
    h.close()


# Each attempt prints its outcome; the escapes are the issue's: hook bypasses first, then what they were used for.
ATTEMPTS = r"""
import json, os, signal, sys
out = {}
def attempt(name, fn):
    try:
        out[name] = "ran: " + repr(fn())[:100]
    except BaseException as e:
        out[name] = type(e).__name__ + ": " + str(e)[:150]

def rebind_builtins():
    import builtins
    saved = builtins.any, builtins.isinstance
    builtins.any, builtins.isinstance = (lambda *a: True), (lambda *a: True)
    try:
        return open("HOST_DIR/builtins.txt", "w").write("pwned")
    finally:
        builtins.any, builtins.isinstance = saved

class Shifty:  # a path that is inside the folder when the hook looks and outside when open() uses it
    looks = 0
    def __fspath__(self):
        Shifty.looks += 1
        return "inside.txt" if Shifty.looks == 1 else "HOST_DIR/fspath.txt"

def dir_fd_write():  # the hook resolves the name against the working directory, the kernel against dir_fd
    folder = os.open("STDLIB", os.O_RDONLY | os.O_DIRECTORY)
    return os.open("MARKER.py", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=folder)

def import_by(name):
    import importlib
    class Sly(str):
        def partition(self, sep):
            return ("json", "", "")
    return importlib.import_module(Sly(name))

attempt("rebind_builtins", rebind_builtins)
attempt("fspath_changes", lambda: open(Shifty(), "w").write("pwned"))
attempt("dir_fd", dir_fd_write)
attempt("import _socket (str subclass)", lambda: import_by("_socket").socket().connect(("127.0.0.1", PORT)))
attempt("import _posixsubprocess", lambda: __import__("importlib").import_module("_posixsubprocess"))
attempt("import _ctypes", lambda: __import__("importlib").import_module("_ctypes"))
sleeper = [sys.executable, "-c", "import time; time.sleep(60)", "MARKER"]  # simulated work: a child to outlive us
attempt("spawn", lambda: os.posix_spawn(sys.executable, sleeper, {}))
attempt("fork", os.fork)
attempt("exec bash", lambda: os.execv("/bin/bash", ["bash", "-c", "echo pwned > HOST_DIR/bash.txt"]))
attempt("kill trainer", lambda: os.kill(HOST_PID, signal.SIGUSR1))
attempt("pidfd_send_signal trainer", lambda: signal.pidfd_send_signal(os.pidfd_open(HOST_PID), signal.SIGUSR1))

# Last: rebinding what os.path.realpath calls makes every path look inside the working directory to the hook.
import posixpath
cwd = os.getcwd()
posixpath.abspath = lambda path: cwd + "/x"
attempt("write outside", lambda: open("HOST_DIR/abspath.txt", "w").write("pwned"))
attempt("delete outside", lambda: os.remove("PLANTED"))
attempt("/dev/shm", lambda: open("/dev/shm/MARKER", "wb").write(bytes(16 << 20)))

def read_trainer():
    found = []
    with open("/proc/HOST_PID/maps") as maps, open("/proc/HOST_PID/mem", "rb") as mem:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            try:
                mem.seek(start)
                chunk = mem.read(end - start)
            except OSError:
                continue
            at = chunk.find(b"PREFIX")
            if at >= 0:
                found.append(chunk[at : at + 80].decode("latin-1"))
    return found
attempt("read trainer memory", read_trainer)

def write_own_memory():  # a bytearray's buffer pointer sits 32 bytes into the object (CPython 3.11, 64-bit)
    victim = bytearray(b"unchanged")
    with open("/proc/self/mem", "r+b") as mem:
        mem.seek(id(victim) + 32)
        pointer = int.from_bytes(mem.read(8), "little")
        mem.seek(pointer)
        mem.write(b"PATCHED!!")
    return bytes(victim)
attempt("write /proc/self/mem", write_own_memory)
attempt("bash binary", lambda: len(open("/bin/bash", "rb").read()))
print(json.dumps(out))
"""


def _outcomes(answer: str) -> dict[str, str]:
    return json.loads(answer.splitlines()[0])


@pytest.mark.usefixtures("kernel_isolation")
def test_the_tools_defaults_refuse_or_contain_each_escape(host: Host):
    # The defaults, but for a wall clock no loaded machine reaches (the call takes 0.1-1 s).
    answer = PythonSandbox(timeout_s=120)({"code": host.fill(ATTEMPTS)})
    outcomes = _outcomes(answer)
    # open() converts a path-like once, before the audit event: the hook and the kernel see the same inside path.
    assert outcomes.pop("fspath_changes") == "ran: 5"
    for name, outcome in outcomes.items():
        assert not outcome.startswith("ran"), f"{name}: {outcome}"
    refused_by_hook = ["import _socket (str subclass)", "import _posixsubprocess", "import _ctypes", "spawn", "fork"]
    refused_by_hook += ["exec bash", "kill trainer", "rebind_builtins"]
    for name in refused_by_hook:
        assert outcomes[name].startswith("PermissionError: sandbox:"), f"{name}: {outcomes[name]}"
    # Past the hook, the kernel: nothing of the host is mounted, what is mounted is read-only, no other pid is seen.
    for name in ["write outside", "delete outside", "read trainer memory", "bash binary"]:
        assert outcomes[name].startswith("FileNotFoundError: [Errno 2]"), f"{name}: {outcomes[name]}"
    for name in ["dir_fd", "/dev/shm", "write /proc/self/mem"]:
        assert outcomes[name].startswith("OSError: [Errno 30] Read-only file system"), f"{name}: {outcomes[name]}"
    assert outcomes["pidfd_send_signal trainer"].startswith("ProcessLookupError")
    host.assert_untouched(answer)


# The sandbox alone: the same bubblewrap command line and seccomp filter, code run without the audit hook.
KERNEL_ONLY = r"""
import ctypes, errno, json, os, signal, socket, threading
libc = ctypes.CDLL(None, use_errno=True)
out = {}
def attempt(name, fn):
    try:
        out[name] = "ran: " + repr(fn())[:100]
    except BaseException as e:
        out[name] = type(e).__name__ + ": " + str(e)[:150]
def syscall(number, *args):
    if libc.syscall(number, *args) == -1:
        raise OSError(ctypes.get_errno(), errno.errorcode[ctypes.get_errno()])
    return "succeeded"
for name, number in SYSCALLS.items():
    attempt(name, lambda number=number: syscall(number, 1, 0, 0, 0, 0, 0))
attempt("fork", os.fork)
attempt("thread", lambda: (lambda t: (t.start(), t.join()))(threading.Thread(target=int)))
attempt("connect host loopback", lambda: socket.create_connection(("127.0.0.1", PORT), timeout=5))
attempt("interfaces", socket.if_nameindex)
attempt("kill trainer", lambda: os.kill(HOST_PID, signal.SIGUSR1))
attempt("pidfd_send_signal trainer", lambda: signal.pidfd_send_signal(os.pidfd_open(HOST_PID), signal.SIGUSR1))
attempt("trainer memory", lambda: open("/proc/HOST_PID/mem", "rb").read(1))
attempt("write outside", lambda: open("HOST_DIR/kernel.txt", "w").write("pwned"))
attempt("delete outside", lambda: os.remove("PLANTED"))
attempt("write stdlib", lambda: open("STDLIB/MARKER.py", "w").write("pwned"))
attempt("/dev/shm", lambda: open("/dev/shm/MARKER", "wb").write(bytes(1 << 20)))
attempt("write /proc/self/mem", lambda: open("/proc/self/mem", "r+b"))
attempt("exec bash", lambda: os.execv("/bin/bash", ["bash", "-c", "echo pwned > HOST_DIR/bash.txt"]))
attempt("fill the disk", lambda: open("big", "wb").write(bytes(2 << 20)))
attempt("root", lambda: sorted(os.listdir("/")))
attempt("site-packages", lambda: [os.listdir(folder) for folder in HIDDEN])
attempt("uid", os.getuid)
attempt("capabilities", lambda: [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")][0])
attempt("processes", lambda: sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
print(json.dumps(out))
"""
REFUSED = ["ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "unshare", "setns", "keyctl"]
REFUSED += ["add_key", "request_key", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "open_by_handle_at"]
REFUSED += ["init_module", "kexec_load", "reboot", "clock_settime"]


@pytest.mark.usefixtures("kernel_isolation")
def test_the_kernel_alone_contains_code_without_the_audit_hook(host: Host):
    import pyseccomp

    view = isolation.probe("bwrap", sys.executable)
    numbers = {name: pyseccomp.resolve_syscall(pyseccomp.system_arch(), name) for name in REFUSED}
    code = host.fill(KERNEL_ONLY).replace("SYSCALLS", repr(numbers)).replace("HIDDEN", repr(view.hidden))
    command = [view.executable, "-I", "-S", "-c", code]
    with isolation.bwrap_command("bwrap", view, command, disk_bytes=1 << 20) as (argv, fd):
        done = subprocess.run(argv, pass_fds=(fd,), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    outcomes = _outcomes(done.stdout)
    for name in REFUSED:
        assert outcomes[name] == "PermissionError: [Errno 1] EPERM", f"{name}: {outcomes[name]}"  # seccomp
    assert outcomes["fork"] == "PermissionError: [Errno 1] Operation not permitted"
    assert outcomes["thread"] == "ran: (None, None)"  # threads stay allowed
    assert outcomes["connect host loopback"].startswith("ConnectionRefusedError")  # its own loopback only
    assert outcomes["interfaces"] == "ran: [(1, 'lo')]"
    for name in ["kill trainer", "pidfd_send_signal trainer"]:
        assert outcomes[name].startswith("ProcessLookupError"), f"{name}: {outcomes[name]}"
    for name in ["trainer memory", "write outside", "delete outside", "exec bash"]:
        assert outcomes[name].startswith("FileNotFoundError"), f"{name}: {outcomes[name]}"
    for name in ["write stdlib", "/dev/shm", "write /proc/self/mem"]:
        assert outcomes[name].startswith("OSError: [Errno 30] Read-only file system"), f"{name}: {outcomes[name]}"
    assert outcomes["fill the disk"].startswith("OSError: [Errno 28] No space left on device")
    assert outcomes["uid"] == f"ran: {isolation.SANDBOX_UID}" and outcomes["capabilities"] == "ran: '0000000000000000'"
    assert outcomes["processes"] == "ran: [1, 2]"  # bubblewrap's init and the code: no other process is visible
    roots = {Path(p).parts[1] for p in view.read_only} | {"dev", "proc", "work"}
    assert outcomes["root"] == f"ran: {sorted(roots)!r}"
    assert outcomes["site-packages"] == f"ran: {[[] for _ in view.hidden]!r}"  # covered where the stdlib holds it
    host.assert_untouched(done.stdout)


@pytest.mark.usefixtures("kernel_isolation")
def test_crash_inputs_become_observations():
    tool = PythonSandbox(timeout_s=120)
    assert tool({"code": "print('\ud800')"}) == (
        "error: the code is not valid Unicode (surrogates not allowed: '\\ud800' at position 7)"
    )
    assert tool({"code": "import signal\nprint('before', flush=True)\nsignal.raise_signal(35)"}) == (
        "before\nerror: killed by SIGRTMIN+1"
    )


def test_the_tool_refuses_to_start_without_isolation(tmp_path: Path):
    with pytest.raises(isolation.IsolationUnavailable) as missing:
        PythonSandbox(bwrap=str(tmp_path / "bwrap"))
    message = str(missing.value)
    assert "\n" not in message and f"'{tmp_path / 'bwrap'}' not found" in message
    assert "apt-get install bubblewrap" in message and "tool_options.python.isolation: none" in message
    # A bubblewrap that is there but cannot make a sandbox (here: one that always fails) is refused too.
    with pytest.raises(isolation.IsolationUnavailable, match="/bin/false could not start a sandbox: exit status 1"):
        PythonSandbox(bwrap="/bin/false")
    with pytest.raises(ValueError, match="isolation must be one of auto, bwrap, none, got 'docker'"):
        PythonSandbox(isolation="docker")
    # Through the config path: the environment is built at start-up and the message is not rewrapped.
    options = {"tools": ["python"], "tool_options": {"python": {"bwrap": str(tmp_path / "bwrap")}}}
    with pytest.raises(isolation.IsolationUnavailable, match=r"^python tool: no kernel isolation"):
        MultiTurnRollout(None, TurnLimits(), env="tools", env_options=options)


def test_isolation_none_runs_and_asks_for_a_warning_every_step(tmp_path: Path):
    unconfined = PythonSandbox(isolation="none", bwrap=str(tmp_path / "bwrap"))  # no probe
    assert unconfined({"code": "print(6 * 7)"}) == "42"
    assert unconfined.warning == UNISOLATED
    options = {"tools": ["calculator", "python"], "tool_options": {"python": {"isolation": "none"}}}
    assert ToolEnv(**options).warnings == [UNISOLATED]
    assert MultiTurnRollout(None, TurnLimits(), env="tools", env_options=options).warnings == [UNISOLATED]
    assert MultiTurnRollout(None, TurnLimits(), env="tools", env_options={"tools": ["calculator"]}).warnings == []
