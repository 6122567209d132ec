"""The disk fills up during a checkpoint; the output folder is read-only."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.faults.conftest import Reference
from tests.faults.harness import STEPS, comparable, compare_checkpoints, error_lines, history, latest, train


def _mount_tmpfs(path: Path, options: str) -> bool:
    """A small tmpfs at `path` (needs root; False where mounting is not allowed)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    return mount.returncode == 0


@contextmanager
def _mounted(path: Path) -> Iterator[None]:
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _file_size_limit(limit: int):
    """preexec_fn: writes past `limit` bytes fail with EFBIG (SIGXFSZ ignored), like a full disk for one file."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.parametrize("async_save", ["false", "true"])
def test_disk_full_during_a_checkpoint_keeps_the_previous_one(
    fault_model: Path, reference: Reference, tmp_path: Path, async_save: str
) -> None:
    """Room for one checkpoint and a half: the second save fails (written in the background: the failure is
    reported by the next save, which waits for it). One line says "no space left" for step 2 and names the
    folder, `latest` still names step 1, the partial save is gone; with room again the run resumes from step 1
    and ends exactly as the uninterrupted run."""
    disk = tmp_path / "disk"
    mode = f"trainer.async_save={async_save}"
    checkpoint_bytes = _size(reference.final)
    room = checkpoint_bytes * 3 // 2 + (256 << 10)
    if _mount_tmpfs(disk, f"size={room}"):  # a real ENOSPC
        with _mounted(disk):
            out = disk / "run"
            code, output = train(out, fault_model, mode)
            _check_refused(code, output, out)
            subprocess.run(["mount", "-o", f"remount,size={64 << 20}", str(disk)], check=True)
            _check_resumes_exactly(out, fault_model, reference, mode)
        return
    # Without root: a file-size limit (EFBIG) on a resumed run that must write its second checkpoint.
    out = tmp_path / "run"
    code, output = train(out, fault_model, "trainer.steps=1", mode)
    assert code == 0, output[-3000:]
    largest = max(f.stat().st_size for f in reference.final.rglob("*") if f.is_file())
    code, output = train(out, fault_model, mode, preexec_fn=_file_size_limit(largest // 2))
    _check_refused(code, output, out)
    _check_resumes_exactly(out, fault_model, reference, mode)


def _check_refused(code: int, output: str, out: Path) -> None:
    assert code == 2, output[-3000:]
    errors = error_lines(output)
    assert len(errors) == 1 and "Traceback" not in output, output[-3000:]
    assert "no space left" in errors[0] and str(out / "checkpoints") in errors[0], errors[0]
    assert "checkpoint step_000000002" in errors[0], errors[0]
    assert latest(out) is not None and latest(out).name == "step_000000001"
    assert (latest(out) / "COMPLETE").is_file()
    assert not list((out / "checkpoints").glob(".tmp_step_*")), "the partial save was left behind"


def _check_resumes_exactly(out: Path, model: Path, reference: Reference, mode: str) -> None:
    code, output = train(out, model, mode)
    assert code == 0, output[-3000:]
    assert "step_000000001" in output  # resumed from the checkpoint the failed save left as latest
    rows = history(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert comparable(rows) == comparable(reference.rows)
    assert compare_checkpoints(latest(out), reference.final).different == []


def test_read_only_output_folder_is_refused_early(fault_model: Path, tmp_path: Path) -> None:
    parent = tmp_path / "read_only"
    if _mount_tmpfs(parent, "ro,size=1m"):  # root ignores chmod; a read-only mount stops it too
        cleanup = _mounted(parent)
    elif os.geteuid() != 0:
        parent.mkdir(exist_ok=True)
        parent.chmod(0o555)
        cleanup = _restore_mode(parent)
    else:
        pytest.skip("running as root without permission to mount: no way to make a folder read-only for root")
    with cleanup:
        out = parent / "run"
        code, output = train(out, fault_model)
    assert code == 2, output[-3000:]
    errors = error_lines(output)
    assert len(errors) == 1 and "Traceback" not in output, output[-3000:]
    assert str(parent) in errors[0], errors[0]
    assert "Loading weights" not in output, "refused only after building the model"


@contextmanager
def _restore_mode(path: Path) -> Iterator[None]:
    try:
        yield
    finally:
        path.chmod(0o755)
