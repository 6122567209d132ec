"""The on-disk layout of checkpoints: names, state files, the `COMPLETE` marker and the atomic publish.

Layout of a checkpoint root (a run's `checkpoints/`):
    step_000000020/           a complete checkpoint
        megatron/             dist_checkpointing (torch_dist): model + optimizer, sharded per rank
        rng/rank_00003.pt     each rank's RNG states (CPU, CUDA, Megatron's tracker)
        trainer_state.json    step, the id of the run that wrote it, scheduler, data position, trainer state
        hf_config.json        the architecture (HF config.json) the weights belong to
        hf/                   (converted checkpoints only) the HF tokenizer and generation files
        COMPLETE              written last
    .tmp_step_000000030/      a save in progress (ignored, removed by the next save)
    latest                    name of the newest complete checkpoint, replaced atomically

A converted checkpoint (`megatron-rl convert hf-to-megatron`) is one such directory on its own, at step 0.
Every directory this package writes (checkpoints, HF model directories) is built under `.tmp_<name>` next to
its final place and renamed when complete, so a crash never leaves a half-written directory under the final name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COMPLETE = "COMPLETE"
LATEST = "latest"
MEGATRON_DIR = "megatron"
RNG_DIR = "rng"
TRAINER_STATE = "trainer_state.json"
HF_CONFIG = "hf_config.json"
HF_EXTRAS_DIR = "hf"
STEP_PREFIX = "step_"  # every step folder's name starts with it (see `step_dir_name`)
_STEP_DIR = re.compile(rf"^{STEP_PREFIX}(\d{{9}})$")
_STAGING = ".tmp_"


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or does not fit the model."""


class DamagedCheckpointError(ValueError):
    """A checkpoint file is missing, truncated or corrupt; the message names the file and the way out."""


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:09d}"


def rng_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / RNG_DIR / f"rank_{rank:05d}.pt"


# ---------------------------------------------------------------------------------------------- atomic publish
def staging_dir(final: Path) -> Path:
    """Where `final` is built before it is published."""
    return final.with_name(f"{_STAGING}{final.name}")


def fresh_staging_dir(final: Path) -> Path:
    """An empty staging directory for `final` (a stale one from a crashed write is removed)."""
    staging = staging_dir(final)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def remove_stale_staging(root: Path) -> None:
    """Remove the staging directories of checkpoint saves that never finished under `root`."""
    for stale in root.glob(f"{_STAGING}{STEP_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)


def publish_dir(staging: Path, final: Path, *, overwrite: bool) -> Path:
    """Rename `staging` to `final`. An existing `final` is replaced if `overwrite`, else it must be empty."""
    if final.exists():
        if overwrite:
            shutil.rmtree(final)
        else:
            final.rmdir()  # raises if not empty
    os.replace(staging, final)
    return final


def publish_checkpoint(staging: Path, final: Path, *, overwrite: bool) -> Path:
    """Mark `staging` complete (its last file) and publish it as `final`."""
    (staging / COMPLETE).write_text("ok\n")
    return publish_dir(staging, final, overwrite=overwrite)


def write_latest(root: Path, checkpoint: Path) -> None:
    """Point `root/latest` at `checkpoint` (replaced atomically)."""
    pointer = root / LATEST
    tmp = pointer.with_name(pointer.name + ".tmp")
    tmp.write_text(checkpoint.name)
    os.replace(tmp, pointer)


# ---------------------------------------------------------------------------------------------- state files
def damaged(checkpoint: Path, problem: str) -> DamagedCheckpointError:
    """The error for `checkpoint` with `problem` ("megatron/x is missing (...)"), naming the way out."""
    older = [p for p in _step_dirs(checkpoint.parent) if p.name < checkpoint.name and is_complete(p)]
    way_out = (
        f"resume from an older checkpoint (trainer.resume={older[-1]}) or re-save it"
        if older
        else "re-save it (no older complete checkpoint is next to it to resume from)"
    )
    return DamagedCheckpointError(f"checkpoint {checkpoint} is damaged: {problem}; {way_out}")


def read_checkpoint_json(checkpoint: Path, name: str) -> Any:
    """The JSON file `name` of `checkpoint`; DamagedCheckpointError naming it if missing or not valid JSON."""
    path = checkpoint / name
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise damaged(checkpoint, f"{name} is missing") from None
    except (OSError, UnicodeDecodeError) as err:
        raise damaged(checkpoint, f"{name} cannot be read ({err})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise damaged(checkpoint, f"{name} is not valid JSON ({err})") from None


def write_trainer_state(
    checkpoint: Path,
    *,
    step: int,
    actor_step: int,
    scheduler: dict | None,
    adam_steps: list[float | None] | None,
    trainer: dict,
    world_size: int,
    run_id: str | None,
    critic: dict | None = None,
) -> None:
    """Write `trainer_state.json`: the step, the actor's step, LR scheduler and Adam step counts, the trainer's own
    state (data position, ...), the world size that wrote the RNG files, the id of the run, and with PPO's critic
    its step, scheduler and Adam step counts (`critic`)."""
    state = {
        "step": step,
        "actor_step": actor_step,
        "scheduler": scheduler,
        "adam_steps": adam_steps,
        "trainer": trainer,
        "world_size": world_size,
        "run_id": run_id,
        **({"critic": critic} if critic is not None else {}),
    }
    (checkpoint / TRAINER_STATE).write_text(json.dumps(state, indent=1, default=str))


def read_trainer_state(path: str | Path) -> dict:
    """A checkpoint's trainer_state.json: step, run_id, the trainer's own state (cheap: no tensors)."""
    return read_checkpoint_json(Path(path), TRAINER_STATE)


def write_hf_config(checkpoint: Path, hf: dict) -> None:
    (checkpoint / HF_CONFIG).write_text(json.dumps(hf, indent=1))


def read_checkpoint_hf_config(path: str | Path) -> dict:
    """The HF config.json stored with a checkpoint (`path` is a checkpoint or a directory of them)."""
    found = resolve_checkpoint_dir(path)
    if not (found / HF_CONFIG).is_file():
        raise CheckpointError(f"{found} has no {HF_CONFIG} (written by an older version?)")
    return read_checkpoint_json(found, HF_CONFIG)


# ---------------------------------------------------------------------------------------------- finding checkpoints
def is_complete(path: Path) -> bool:
    return (path / COMPLETE).is_file()


@dataclass(frozen=True)
class CheckpointScan:
    """The checkpoints under one directory: complete ones (oldest first), incomplete ones (a `step_*` folder
    without `COMPLETE`: damaged or copied half-way; a save in progress is a `.tmp_*` folder, not listed), and the
    one to resume from (the one `latest` names if complete, else the newest complete one)."""

    complete: tuple[Path, ...]
    incomplete: tuple[Path, ...]
    latest: Path | None


def _step_dirs(root: Path) -> list[Path]:
    """The step folders under `root` (complete or not), oldest first."""
    return sorted(p for p in root.glob(f"{STEP_PREFIX}*") if _STEP_DIR.match(p.name) and p.is_dir())


def scan_checkpoints(root: str | Path) -> CheckpointScan:
    root = Path(root)
    steps = _step_dirs(root)
    complete = tuple(p for p in steps if is_complete(p))
    incomplete = tuple(p for p in steps if not is_complete(p))
    pointer, latest = root / LATEST, complete[-1] if complete else None
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if candidate in complete:
            latest = candidate
    return CheckpointScan(complete, incomplete, latest)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    return scan_checkpoints(root).latest


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """`path` if it is a complete checkpoint, else the newest complete checkpoint under it."""
    path = Path(path)
    found = path if is_complete(path) else latest_checkpoint(path)
    if found is None:
        raise CheckpointError(
            f"no complete checkpoint at {path} (a checkpoint directory holds {COMPLETE}, {HF_CONFIG} and "
            f"{MEGATRON_DIR}/)"
        )
    return found


def error_summary(err: BaseException, limit: int = 400) -> str:
    """One line for an error whose text may hold tracebacks (torch DCP's CheckpointException)."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)]
    line = named[-1] if named else (lines[0] if lines else type(err).__name__)
    return line if len(line) <= limit else line[: limit - 3] + "..."
