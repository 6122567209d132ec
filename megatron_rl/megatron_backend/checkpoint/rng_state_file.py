"""A checkpoint's per-rank RNG state file (`rng/rank_NNNNN.pt`): tensors only, read with `weights_only=True`.

The state is `{"cpu": ByteTensor, "tracker": {name: ByteTensor}, "cuda": ByteTensor (CUDA runs)}`: torch's CPU
generator, Megatron's model/data/expert-parallel tracker states and the CUDA generator, each a uint8 tensor (the
format every checkpoint of this project has had, so older checkpoints read unchanged). torch's restricted
unpickler (`weights_only=True`) reads tensors, dicts and plain Python values and refuses any other global, so a
crafted file cannot run code when a run resumes from it.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import torch

from megatron_rl.formats.checkpoint_format import damaged, error_summary


def read_rng_state(checkpoint: Path, path: Path) -> dict[str, Any]:
    """The RNG state in `path` (a file of `checkpoint`); `DamagedCheckpointError` naming the file when it is
    truncated, holds anything but tensors and plain values (refused unread: loading it would run code), or is
    not an RNG state."""
    name = path.relative_to(checkpoint)
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        if "Weights only load failed" not in str(err):
            raise damaged(checkpoint, f"{name} is truncated/corrupt ({error_summary(err)})") from err
        found = re.search(r"GLOBAL (\S+)", str(err))
        what = f" ({found.group(1)})" if found else ""
        raise damaged(
            checkpoint,
            f"{name} holds a pickled object other than tensors and plain values{what}; refused without loading "
            "it (it would run code): this project's RNG files hold only tensors, so the file was not written by "
            "it or was tampered with",
        ) from None
    except Exception as err:  # noqa: BLE001 - a truncated zip or a short read: the same for the user
        raise damaged(checkpoint, f"{name} is truncated/corrupt ({error_summary(err)})") from err
    problem = rng_state_problem(state)
    if problem:
        raise damaged(checkpoint, f"{name} is not an RNG state: {problem}")
    return state


def rng_state_problem(state: Any) -> str:
    """Why `state` is not an RNG state of the format above, or ''."""
    if not isinstance(state, dict):
        return f"a {type(state).__name__}, not a mapping"
    tracker = state.get("tracker")
    if not torch.is_tensor(state.get("cpu")) or not isinstance(tracker, dict):
        return f"keys {sorted(map(str, state))}, expected 'cpu' (a tensor) and 'tracker' (a mapping)"
    tensors = {"cpu": state["cpu"], **{f"tracker.{k}": v for k, v in tracker.items()}}
    if "cuda" in state:
        tensors["cuda"] = state["cuda"]
    bad = [k for k, v in tensors.items() if not torch.is_tensor(v) or v.dtype != torch.uint8]
    return f"{', '.join(bad)} not a uint8 tensor" if bad else ""
