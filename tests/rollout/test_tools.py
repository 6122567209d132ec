"""Shipped tools: the AST calculator, and the Python sandbox's limits (each escape stopped and reported)."""

from __future__ import annotations

import os
import time

import pytest

from megatron_rl.rollout.agent.tools import get_tool, tool_schema
from megatron_rl.rollout.agent.tools.calculator import Calculator, evaluate
from megatron_rl.rollout.agent.tools.python_sandbox import PythonSandbox


# ---------------------------------------------------------------------------------------------- calculator
@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("(12 + 7) * 3", 57),
        ("-3 ** 2", -9),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("-7 % 3", 2),
        ("2 ** -1", 0.5),
        ("+1.5e3 - 0.5", 1499.5),
        ("123456789 * 987654321", 121932631112635269),
        ("2 ** 4095 // 2 ** 4094", 2),
    ],
)
def test_calculator_values(expression: str, value: float):
    result = evaluate(expression)
    assert result == value and type(result) is type(value)


@pytest.mark.parametrize(
    ("expression", "answer"),
    [
        ("x + 1", "error: unsupported: 'x' (only numbers, + - * / // % ** and parentheses)"),
        ("__import__('os').system('ls')", "error: unsupported: \"__import__('os').system('ls')\""),
        ("(1).__class__", "error: unsupported: '1 .__class__'"),
        ("True + 1", "error: unsupported: 'True'"),
        ("1 < 2", "error: unsupported: '1 < 2'"),
        ("1 +", "error: not an arithmetic expression"),
        ("1 / 0", "error: division by zero"),
        ("9 ** 9 ** 9", "error: result larger than 4096 bits"),  # refused before computing
        ("(2 ** 4000) * (2 ** 4000)", "error: result larger than 4096 bits"),
        ("(-8) ** 0.5", "error: complex result"),
        ("1e308 * 10", "error: result is not a finite number"),
        ("10.0 ** 400", "error: (34, 'Numerical result out of range')"),
        ("1+" * 300 + "1", "error: expression longer than 500 characters"),
        ("1" * 5000, "error: expression longer than 500 characters"),  # refused before int() converts it
        ("1e10000000", "error: result is not a finite number"),
        ("2 ** \ud800", "error: not an arithmetic expression (surrogates not allowed)"),  # a lone surrogate
        ("1\x00", "error: not an arithmetic expression"),
    ],
)
def test_calculator_errors_are_answers(expression: str, answer: str):
    assert Calculator()({"expression": expression}).startswith(answer)


def test_calculator_tool_interface():
    calc = get_tool("calculator")
    assert calc({"expression": "2 ** 10"}) == "1024"
    assert calc({"expr": "1"}) == 'error: the calculator needs "expression" as a string'
    assert tool_schema(calc)["function"]["name"] == "calculator"
    assert tool_schema(calc)["function"]["parameters"]["required"] == ["expression"]
    start = time.perf_counter()
    assert calc({"expression": "9 ** 9 ** 9 ** 9"}).startswith("error")
    assert time.perf_counter() - start < 0.1


# ---------------------------------------------------------------------------------------------- sandbox
@pytest.fixture(scope="module")
def sandbox(kernel_isolation) -> PythonSandbox:
    return PythonSandbox(timeout_s=30.0, cpu_s=1, memory_mb=256, file_mb=1, output_chars=200)  # no wall clock hit


def test_normal_code_prints_its_result(sandbox: PythonSandbox):
    code = "import json, math\nprint(json.dumps({'r': math.factorial(10)}))\nopen('out.txt', 'w').write('kept')\n"
    code += "print(open('out.txt').read())"
    assert sandbox({"code": code}) == '{"r": 3628800}\nkept'


def test_child_limits_are_set_in_the_kernel(sandbox: PythonSandbox):
    code = "import resource as r, os\n"
    code += "print([r.getrlimit(getattr(r, 'RLIMIT_' + k)) for k in ('CPU', 'AS', 'NPROC', 'FSIZE', 'CORE')])\n"
    code += "print(os.getpid(), sorted(os.environ))"
    assert sandbox({"code": code}) == (  # pid 2 in its own pid namespace (1 is bubblewrap's init)
        f"[(1, 2), ({256 << 20}, {256 << 20}), (0, 0), ({1 << 20}, {1 << 20}), (0, 0)]\n2 ['LANG', 'PWD']"
    )


@pytest.mark.usefixtures("kernel_isolation")
def test_infinite_loop_is_stopped_by_the_cpu_limit():
    # The wall-clock timeout is far away: it is the 1 s of CPU time that stops the loop (however loaded the machine).
    assert PythonSandbox(timeout_s=60.0, cpu_s=1)({"code": "while True: pass"}) == (
        "error: killed by SIGXCPU (CPU time limit)"
    )
    catching = "import signal\nsignal.signal(signal.SIGXCPU, lambda *a: None)\nwhile True: pass"
    assert PythonSandbox(timeout_s=60.0, cpu_s=1)({"code": catching}) == "error: killed by SIGKILL"  # the hard limit


@pytest.mark.usefixtures("kernel_isolation")
def test_sleeping_code_is_stopped_by_the_wall_clock_timeout():
    quick = PythonSandbox(timeout_s=2.0)
    start = time.perf_counter()
    assert quick({"code": "import time\nprint('before', flush=True)\ntime.sleep(30)  # simulated work"}) == (
        "before\nerror: timed out after 2 s (killed)"
    )
    assert time.perf_counter() - start < 5.0


def _last_line(answer: str) -> tuple[str, str]:
    lines = answer.splitlines()
    return lines[-2], lines[-1]


@pytest.mark.parametrize(
    ("code", "error"),
    [
        ("import os\nwhile True:\n    os.fork()", "PermissionError: sandbox: os.fork refused"),
        ("import os\nos.system('touch /tmp/pwned')", "PermissionError: sandbox: os.system refused"),
        ("import subprocess", "PermissionError: sandbox: import subprocess refused"),
        ("import ctypes", "PermissionError: sandbox: import ctypes refused"),
        ("import socket", "PermissionError: sandbox: import socket refused"),
        ("import urllib.request", "PermissionError: sandbox: import socket refused"),
        ("import _socket", "PermissionError: sandbox: import _socket refused"),
        ("open('/tmp/megatron_rl_sandbox_escape', 'w')", "sandbox: writing '/tmp/megatron_rl_sandbox_escape' refused"),
        ("open('../escape', 'w')", "PermissionError: sandbox: writing '../escape' refused"),
        ("import os\nos.symlink('/tmp', 'l')\nopen('l/escape', 'w')", "sandbox: writing 'l/escape' refused"),
        ("open('/etc/hostname').read()", "PermissionError: sandbox: reading '/etc/hostname' refused"),
        ("import os\nos.remove('/tmp/x')", "PermissionError: sandbox: os.remove '/tmp/x' refused"),
        ("import os, pathlib\nos.remove(pathlib.Path('/tmp/x'))", "sandbox: os.remove '/tmp/x' refused"),
        ("import os\nos.rename('a', '/tmp/x')", "PermissionError: sandbox: os.rename 'a' refused"),
        ("import os\nos.kill(1, 9)", "PermissionError: sandbox: os.kill refused"),
        ("import resource as r\nr.setrlimit(r.RLIMIT_CPU, (5, 5))", "sandbox: resource.setrlimit refused"),
        ("import __main__\n__main__._REFUSED_EVENTS = ()\nimport os\nos.fork()", "sandbox: os.fork refused"),
        ("x = bytearray(2 ** 31)", "MemoryError"),
    ],
)
def test_escapes_are_refused_and_reported(sandbox: PythonSandbox, code: str, error: str):
    answer = sandbox({"code": code})
    assert answer.startswith('stderr:\nTraceback (most recent call last):\n  File "<code>"')
    message, status = _last_line(answer)
    assert message.endswith(error)
    assert status == "exit status 1"
    assert not os.path.exists("/tmp/megatron_rl_sandbox_escape") and not os.path.exists("/tmp/pwned")


def _unprivileged_sandbox() -> PythonSandbox:
    """As root, RLIMIT_NPROC needs the child to run as another user (with an interpreter that user can run)."""
    if os.geteuid() != 0:
        return PythonSandbox(timeout_s=10.0)
    if not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("running as root and no /usr/bin/python3 for an unprivileged child")
    return PythonSandbox(timeout_s=10.0, user=65534, interpreter="/usr/bin/python3")


@pytest.mark.usefixtures("kernel_isolation")
def test_the_kernel_refuses_new_threads_and_processes():
    """Threads pass the audit hook: it is RLIMIT_NPROC that stops them (and so any fork the hook would miss)."""
    code = "import os, threading\nprint(os.getuid() != 0)\nthreading.Thread(target=print).start()"
    answer = _unprivileged_sandbox()({"code": code})
    assert answer.startswith("True\nstderr:\n")
    assert _last_line(answer) == ("RuntimeError: can't start new thread", "exit status 1")


def test_output_is_bounded(sandbox: PythonSandbox):
    assert sandbox({"code": "print('x' * 10_000)"}) == "x" * 200 + "... [truncated]"
    answer = sandbox({"code": "import sys\nsys.stdout.write('y' * (2 << 20))"})  # past RLIMIT_FSIZE (1 MiB)
    assert answer.startswith("y" * 200 + "... [truncated]\nstderr:\n")
    assert _last_line(answer) == ("OSError: [Errno 27] File too large", "exit status 1")


@pytest.mark.usefixtures("kernel_isolation")
def test_bad_arguments_and_registry():
    assert get_tool("python")({"program": "1"}) == 'error: python needs "code" as a string'
    assert get_tool("python", timeout_s=2.0).timeout_s == 2.0
    missing = PythonSandbox(interpreter="/nonexistent/python", isolation="none")
    assert missing({"code": "1"}) == "error: the sandbox could not start (FileNotFoundError)"  # logged, not raised
    with pytest.raises(ValueError, match="cannot inspect the interpreter '/nonexistent/python'"):
        PythonSandbox(interpreter="/nonexistent/python")  # isolated: refused at start-up
    with pytest.raises(ValueError, match="unknown tool 'browser'"):
        get_tool("browser")
