"""A checkpoint's RNG files are read with torch's restricted unpickler
(megatron_backend/checkpoint/rng_state_file.py): the
files every checkpoint of this project has written load unchanged, a crafted one that would run code is refused
by name without running it, and anything that is not an RNG state is refused by name."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest
import torch

from megatron_rl.formats.checkpoint_format import DamagedCheckpointError, rng_file
from megatron_rl.megatron_backend.checkpoint.rng_state_file import read_rng_state


class ShellPayload:
    """Unpickled, runs `touch <marker>` through os.system (what a crafted checkpoint would run)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def old_saver_state() -> dict:
    """The state as `checkpoint._rng_state` has always saved it (a CUDA run adds "cuda"): uint8 tensors."""
    state = torch.get_rng_state()
    tracker = {name: state.clone() for name in ("data-parallel-rng", "model-parallel-rng", "expert-parallel-rng")}
    return {"cpu": state, "tracker": tracker, "cuda": torch.zeros(16, dtype=torch.uint8)}


def checkpoint_with(tmp_path: Path, content: object) -> tuple[Path, Path]:
    checkpoint = tmp_path / "checkpoints" / "step_000000002"
    path = rng_file(checkpoint, 0)
    path.parent.mkdir(parents=True)
    torch.save(content, path)
    return checkpoint, path


def test_a_file_of_the_old_saver_reads_unchanged(tmp_path: Path) -> None:
    saved = old_saver_state()
    got = read_rng_state(*checkpoint_with(tmp_path, saved))
    assert set(got) == {"cpu", "tracker", "cuda"} and set(got["tracker"]) == set(saved["tracker"])
    assert torch.equal(got["cpu"], saved["cpu"]) and torch.equal(got["cuda"], saved["cuda"])
    assert all(torch.equal(got["tracker"][k], v) for k, v in saved["tracker"].items())


def test_a_pickled_callable_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    checkpoint, path = checkpoint_with(tmp_path, {**old_saver_state(), "cpu": ShellPayload(marker)})
    torch.load(path, weights_only=False)  # the payload is live: the unrestricted unpickler runs it
    assert marker.exists()
    marker.unlink()
    with pytest.raises(DamagedCheckpointError) as err:
        read_rng_state(checkpoint, path)
    assert not marker.exists()
    message = str(err.value)
    assert f"checkpoint {checkpoint} is damaged: rng/rank_00000.pt holds a pickled object other than tensors" in message
    assert "posix.system" in message and "it would run code" in message, message


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ([1, 2], "is not an RNG state: a list, not a mapping"),
        ({"cpu": torch.zeros(3)}, "expected 'cpu' (a tensor) and 'tracker' (a mapping)"),
        ({"cpu": torch.zeros(3, dtype=torch.uint8), "tracker": {"model-parallel-rng": 7}}, "tracker.model-parallel"),
    ],
)
def test_content_that_is_not_an_rng_state_is_refused_by_name(tmp_path: Path, content: object, problem: str) -> None:
    with pytest.raises(DamagedCheckpointError, match="rng/rank_00000.pt") as err:
        read_rng_state(*checkpoint_with(tmp_path, content))
    assert problem in str(err.value), str(err.value)


def test_a_truncated_file_is_named(tmp_path: Path) -> None:
    checkpoint, path = checkpoint_with(tmp_path, old_saver_state())
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(DamagedCheckpointError, match=r"rng/rank_00000.pt is truncated/corrupt"):
        read_rng_state(checkpoint, path)
