"""The sandboxed interpreter's start-up (run as ``python -I -S sandbox_child.py WORKDIR CPU_S MEMORY FILE_SIZE``).

It lowers its own resource limits (kernel-enforced; hard limits the code cannot raise), reads the code
from stdin, installs an audit hook (PEP 578) that refuses network, process creation, file writes outside WORKDIR
and reads outside WORKDIR and the standard library, then runs the code. The audit hook is a tripwire, not a
boundary: PEP 578 itself says hooks cannot sandbox code running in the same interpreter (see
`python_sandbox.py` for what each layer enforces).
"""

import linecache
import os
import resource
import sys
import traceback

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_REFUSED_EVENTS = (
    "socket.",
    "os.fork",
    "os.forkpty",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.kill",
    "os.killpg",
    "os.setsid",
    "signal.pthread_kill",
    "subprocess.",
    "pty.",
    "ctypes.",
    "resource.setrlimit",
    "resource.prlimit",
    "code.__new__",
    "gc.get_",
    "sys.remote_exec",
)
_REFUSED_MODULES = frozenset(
    "ctypes _ctypes socket _socket ssl _ssl subprocess _posixsubprocess multiprocessing _multiprocessing pty".split()
)
_WRITE_EVENTS = frozenset(
    "os.remove os.rename os.rmdir os.mkdir os.chmod os.chown os.link os.symlink os.truncate os.utime".split()
)


def _limit(kind: int, value: int, hard: int | None = None) -> None:
    resource.setrlimit(kind, (value, value if hard is None else hard))


def _run(code: str) -> None:
    """Run `code` as __main__; on an exception print a traceback of the code's own frames only, exit status 1."""
    linecache.cache["<code>"] = (len(code), None, code.splitlines(True), "<code>")
    try:
        exec(compile(code, "<code>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - reported to the model like the interpreter would
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == "<code>"]
        trace = "".join(traceback.format_list(frames)) + "".join(traceback.format_exception_only(exc))
        sys.stderr.write("Traceback (most recent call last):\n" + trace)
        sys.exit(1)


def _install_hook(workdir: str, read_roots: tuple[str, ...]) -> None:
    # Everything the hook reads is bound as a default argument: module globals and builtins (`any`, `isinstance`)
    # could be rebound by the code. What realpath calls inside posixpath can still be rebound: a tripwire only.
    def inside(path, roots, fspath=os.fspath, realpath=os.path.realpath, sep=os.sep, any=any, type=type) -> bool:
        try:
            full = realpath(fspath(path))
        except (TypeError, ValueError, OSError):
            return False
        if type(full) is bytes:
            full = full.decode("utf-8", "surrogateescape")
        if type(full) is not str:
            return False
        return any(full == root or full.startswith(root + sep) for root in roots)

    def hook(
        event,
        args,
        inside=inside,
        isinstance=isinstance,
        any=any,
        type=type,
        str=str,
        writable=(workdir,),
        readable=(workdir, *read_roots),
        refused_events=_REFUSED_EVENTS,
        refused_modules=_REFUSED_MODULES,
        write_events=_WRITE_EVENTS,
        write_flags=_WRITE_FLAGS,
    ) -> None:
        if event.startswith(refused_events):
            raise PermissionError(f"sandbox: {event} refused")
        if event == "import" and (type(args[0]) is not str or str.partition(args[0], ".")[0] in refused_modules):
            raise PermissionError(f"sandbox: import {str.__repr__(args[0])[1:-1]} refused")
        if event == "object.__setattr__" and args[1] in ("__code__", "__defaults__", "__kwdefaults__"):
            raise PermissionError("sandbox: replacing a function's code refused")
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int):
                return  # an already open descriptor
            writing = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & write_flags)
            if not inside(path, writable if writing else readable):
                raise PermissionError(f"sandbox: {'writing' if writing else 'reading'} {path!r} refused")
        elif event in write_events or event == "os.chdir":
            paths = args[1:2] if event == "os.symlink" else [a for a in args[:2] if isinstance(a, str | bytes)]
            if not all(inside(p, writable) for p in paths):
                raise PermissionError(f"sandbox: {event} {args[0]!r} refused")
        elif event in ("os.listdir", "os.scandir") and not inside(args[0] or ".", readable):
            raise PermissionError(f"sandbox: listing {args[0]!r} refused")

    sys.addaudithook(hook)


def main() -> None:
    workdir, cpu_s, memory, file_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    _limit(resource.RLIMIT_CPU, cpu_s, cpu_s + 1)  # SIGXCPU at the limit, SIGKILL a second later
    _limit(resource.RLIMIT_AS, memory)
    _limit(resource.RLIMIT_FSIZE, file_size)
    _limit(resource.RLIMIT_NPROC, 0)  # no fork, no thread (not enforced for root)
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_NOFILE, 64)
    code = sys.stdin.buffer.read().decode("utf-8", "replace")
    sys.stdin.close()
    roots = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    _install_hook(os.path.realpath(workdir), tuple(sorted(roots)))
    del sys.argv[1:]
    _run(code)


main()
