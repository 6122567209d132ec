"""One output folder, one run: who owns `trainer.output_dir`, and where a start continues from.

A run is identified in `output_dir/run.json` by a random id, its creation time and a hash of its resolved config
without the fields that may change between the starts of one run (its length, the resume/overwrite switches,
checkpoint cadence, logging, where the rollout servers are). Before any model is built, `plan_run` reads the
folder and decides: start fresh, continue from a checkpoint, stop because the run is already complete, or refuse
with one line naming the folder and the ways out. It writes nothing; `start_run` (rank 0) carries the plan out.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shlex
import shutil
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from megatron_rl.config import to_dict
from megatron_rl.config.schema import RLConfig
from megatron_rl.formats import checkpoint_format
from megatron_rl.trainer.guards.stop_signals import under_torchrun

RUN_FILE = "run.json"
# Dotted config keys (and the keys under them) that may change between the starts of one run: its length and
# switches, checkpoint cadence, logging, and how it is deployed (parallel layout, memory phases, where and how
# the rollout servers run) -- a requeued job may land on other nodes. Everything else identifies the run.
RESUMABLE_CHANGES = (
    "trainer.steps",
    "trainer.resume",
    "trainer.overwrite",
    "trainer.save_on_interrupt",
    "trainer.save_every",
    "trainer.keep_last",
    "trainer.output_dir",
    "trainer.on_nonfinite",
    "trainer.stop_on",
    "trainer.micro_batch_tokens",
    "trainer.balance_quadratic",
    "trainer.offload_actor",
    "model.options.experts",  # how the same numbers are computed (up to rounding), not which
    "model.options.packing",
    "optimizer.cpu_offload",
    "optimizer.offload_fraction",
    "optimizer.overlap_offload_transfers",
    "logging",
    "parallel",
    "rollout.sglang",
    "rollout.side_models",  # where they are served; which one a judge or teacher is stays in its side:<name>
    "rollout.bucket_mb",
    "rollout.restarts_per_step",
    "rollout.release_memory",
    "trainer.async_save",
    "algo.replay_check",  # what replay verifies and measures, not what it computes
    "algo.replay_agreement_every",
)

# Keys added to the config after runs were started, with the default that computes what those runs computed: at
# that value they do not count toward the run's identity, so such a run still resumes.
ADDED_LATER = {
    "model.options.expert_bias_update_rate": 0.0,
    "optimizer.precision_aware": False,
    "optimizer.main_params_dtype": "fp32",
    "optimizer.moments_dtype": "fp32",
}


class RunDirError(ValueError):
    """`trainer.output_dir` cannot be used as asked; the message names the folder and the ways out."""


@dataclass(frozen=True)
class RunIdentity:
    """What `run.json` records. `run_id` also tags every checkpoint the run writes and is the wandb run id."""

    run_id: str
    created: str  # ISO 8601, UTC
    config_hash: str


@dataclass(frozen=True)
class RunPlan:
    output_dir: Path
    identity: RunIdentity
    resume_from: Path | None  # the checkpoint to load; None = start at step 0
    start_step: int  # the checkpoint's step (0 without one)
    steps: int  # trainer.steps
    move_aside_to: Path | None  # trainer.overwrite: the previous run's folder is renamed to this first
    notes: tuple[str, ...] = ()  # lines to print when the run starts

    @property
    def complete(self) -> bool:
        """The checkpoint is at (or past) trainer.steps: nothing to do."""
        return self.resume_from is not None and self.start_step >= self.steps

    @property
    def checkpoint_root(self) -> Path:
        return self.output_dir / "checkpoints"

    @property
    def first_logged_step(self) -> int:
        """Metrics rows from this step on are (re)written by this start; earlier ones are kept."""
        return self.start_step + 1 if self.resume_from is not None else 0

    def complete_message(self) -> str:
        return (
            f"{self.output_dir}: the run is already complete (checkpoint step {self.start_step}, trainer.steps="
            f"{self.steps}); nothing to do. To train further, raise trainer.steps above {self.start_step}"
        )


# ---------------------------------------------------------------------------------------------- checks
def check_output_dir(path: str | Path) -> None:
    """One line if `path` cannot hold a run: it (or the nearest existing parent) is a file, or is not writable."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise RunDirError(f"trainer.output_dir={path} is a file, not a folder: choose another trainer.output_dir")
    existing = path.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise RunDirError(
            f"trainer.output_dir={path}: {existing} is a file, not a folder: choose another trainer.output_dir"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunDirError(
            f"trainer.output_dir={path}: {existing} is not writable: choose another trainer.output_dir "
            "or make it writable"
        )


def comparable_config(cfg: RLConfig | dict[str, Any]) -> dict[str, Any]:
    """The flattened resolved config that identifies a run: without `RESUMABLE_CHANGES` and secrets."""
    flat = _flatten(json.loads(json.dumps(cfg if isinstance(cfg, dict) else to_dict(cfg), default=str)))
    return {
        key: value
        for key, value in flat.items()
        if not any(key == p or key.startswith(p + ".") for p in RESUMABLE_CHANGES)
        and not (key in ADDED_LATER and value == ADDED_LATER[key])
        and "api_key" not in key
        and "secret" not in key
    }


def config_hash(cfg: RLConfig | dict[str, Any]) -> str:
    text = json.dumps(comparable_config(cfg), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def changed_keys(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    a, b = comparable_config(before), comparable_config(after)
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def holds_run_data(output_dir: Path) -> bool:
    """Checkpoints (complete or not, or a `latest` pointer) or metrics rows: what a fresh run must not mix with."""
    root = output_dir / "checkpoints"
    metrics = output_dir / "metrics.jsonl"
    has_checkpoints = root.is_dir() and any(
        p.name == checkpoint_format.LATEST or p.name.startswith(checkpoint_format.STEP_PREFIX) for p in root.iterdir()
    )
    return has_checkpoints or (metrics.is_file() and metrics.stat().st_size > 0)


def read_identity(output_dir: Path) -> RunIdentity | None:
    file = output_dir / RUN_FILE
    if not file.is_file():
        return None
    try:
        return RunIdentity(**{k: v for k, v in json.loads(file.read_text()).items() if k != "wandb_id"})
    except (OSError, ValueError, TypeError) as err:
        raise RunDirError(
            f"{file} is unreadable ({err}): restore it, choose another trainer.output_dir, or set "
            "trainer.overwrite=true to move the old run aside"
        ) from err


# ---------------------------------------------------------------------------------------------- the plan
def plan_run(cfg: RLConfig, *, now: datetime | None = None) -> RunPlan:
    """Decide how this start uses `trainer.output_dir` (reads only). Raises RunDirError / CheckpointError."""
    t = cfg.trainer
    out = Path(t.output_dir)
    check_output_dir(out)
    now = now or datetime.now(UTC)
    digest = config_hash(cfg)
    fresh = RunIdentity(run_id=secrets.token_hex(8), created=now.isoformat(timespec="seconds"), config_hash=digest)
    explicit = t.resume not in ("auto", "never")
    previous = read_identity(out)
    has_data = holds_run_data(out)

    if t.overwrite:
        if explicit and _inside(Path(t.resume), out):
            raise RunDirError(
                f"trainer.overwrite=true moves {out} aside, so it cannot also resume from {t.resume} inside it: "
                "drop one of the two"
            )
        aside = _aside_name(out, now) if (previous is not None or has_data) else None
        return _plan_from(out, fresh, Path(t.resume) if explicit else None, t.steps, move_aside_to=aside)
    if not has_data:  # nothing to lose; a restart of the same config keeps its id
        same = previous is not None and previous.config_hash == digest and t.resume != "never"
        identity = previous if previous is not None and same else fresh
        return _plan_from(out, identity, Path(t.resume) if explicit else None, t.steps)
    if t.resume == "never":
        raise _refusal(out, "trainer.resume=never starts a fresh run")
    if explicit:
        if not _inside(Path(t.resume), out):
            raise _refusal(out, f"trainer.resume={t.resume} starts a new run from a checkpoint outside it")
        notes = []
        if previous is None:
            identity = fresh
            notes.append(f"{out}: adopting the run found there (it has no {RUN_FILE}) as trainer.resume asks")
        else:
            identity = replace(previous, config_hash=digest)
            if previous.config_hash != digest:
                changed = _listing(_changed_since_last_start(out, cfg))
                notes.append(f"{out}: continuing the run with a changed config ({changed}) as trainer.resume asks")
        return _plan_from(out, identity, Path(t.resume), t.steps, notes=notes)
    if previous is None:
        raise _refusal(
            out,
            f"no {RUN_FILE} says which run wrote them: an older version?",
            resume=f"trainer.resume={out / 'checkpoints'}",
        )
    if previous.config_hash != digest:
        differing = _changed_since_last_start(out, cfg)
        raise _refusal(
            out,
            f"its run has another config: {_listing(differing)}",
            resume=f"its own config ({out / 'config.yaml'}) with trainer.resume=auto, or trainer.resume="
            f"{out / 'checkpoints'} to continue it with this config",
        )
    return _plan_from(out, previous, out / "checkpoints", t.steps, auto=True)


def start_run(plan: RunPlan) -> None:
    """Rank 0: move a previous run aside (trainer.overwrite), record the run in run.json, report the plan."""
    if plan.move_aside_to is not None:
        plan.output_dir.rename(plan.move_aside_to)
        print(f"trainer.overwrite=true: moved the previous run in {plan.output_dir} to {plan.move_aside_to}",
              flush=True)  # fmt: skip
    plan.output_dir.mkdir(parents=True, exist_ok=True)
    record = {**asdict(plan.identity), "wandb_id": plan.identity.run_id}
    tmp = plan.output_dir / f".{RUN_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, plan.output_dir / RUN_FILE)
    for note in plan.notes:
        print(note, flush=True)


def resume_command(cfg: RLConfig, config_path: str | None, overrides: Sequence[str] = ()) -> str:
    """The command line that continues this run, with trainer.resume=auto: `megatron-rl train` with the same config
    and overrides; under torchrun the torchrun command line that launched this process (its agent is the parent);
    under SLURM, also: resubmit the job (the templates requeue it and resume)."""
    if config_path is None:
        config_path, overrides = str(Path(cfg.trainer.output_dir) / "config.yaml"), ()
    kept = [o for o in overrides if not o.removeprefix("--").startswith(("trainer.resume=", "trainer.overwrite="))]
    extra = ["trainer.resume=auto"] + (["trainer.overwrite=false"] if cfg.trainer.overwrite else [])
    args = ["train", config_path, *kept, *extra]
    launcher = _torchrun_launcher()
    if launcher is not None:
        command = shlex.join([*launcher, *args])
    elif under_torchrun():  # the agent's command line is unreadable: say what to keep
        command = "torchrun (with this run's options) " + shlex.join(["-m", "megatron_rl.cli", *args])
    else:
        command = shlex.join(["megatron-rl", *args])
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        return f"sbatch the same job script again (SLURM job {job}; trainer.resume=auto continues the run) or {command}"
    return command


def _torchrun_launcher() -> list[str] | None:
    """Under torchrun: its command line with the CLI as the worker's entry point (`torchrun --nproc-per-node 2 -m
    megatron_rl.cli`), read from this worker's parent, torchrun's agent; None outside torchrun or when the parent's
    command line is unreadable."""
    if not under_torchrun():
        return None
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
        parent = [a.decode(errors="surrogateescape") for a in raw.removesuffix(b"\0").split(b"\0")]
    except OSError:
        try:
            import psutil

            parent = psutil.Process().parent().cmdline()
        except Exception:  # noqa: BLE001 - no psutil, or no parent: fall back to the plain command
            return None
    tail = sys.argv[1:]  # the worker's arguments end the agent's command line, after the entry point
    if len(parent) <= len(tail) or parent[len(parent) - len(tail) :] != tail:
        return None
    head = parent[: len(parent) - len(tail)]
    head = head[:-2] if len(head) >= 2 and head[-2] == "-m" else head[:-1]  # drop `-m module` or `script.py`
    if len(head) >= 2 and Path(head[1]).name == "torchrun" and shutil.which("torchrun") == head[1]:
        head = head[1:]  # `python /usr/bin/torchrun ...` is the `torchrun` on PATH: show it as typed
    if head and Path(head[0]).name == "torchrun" and shutil.which("torchrun") == head[0]:
        head = ["torchrun", *head[1:]]
    if not head:
        return None
    no_python = "--no-python" in head or "--no_python" in head  # torchrun runs the entry point as a program
    return [*head, "megatron-rl"] if no_python else [*head, "-m", "megatron_rl.cli"]


# ---------------------------------------------------------------------------------------------- helpers
def _plan_from(
    out: Path,
    identity: RunIdentity,
    source: Path | None,
    steps: int,
    *,
    auto: bool = False,
    move_aside_to: Path | None = None,
    notes: list[str] | None = None,
) -> RunPlan:
    """The plan for continuing from the newest complete checkpoint at `source` (a checkpoint or a folder of them;
    under `auto`, having none at all means starting at step 0)."""
    notes = list(notes or [])
    resume_from = None
    if source is not None:
        if (source / checkpoint_format.COMPLETE).is_file():
            resume_from = source
        else:
            scan = checkpoint_format.scan_checkpoints(source)
            skipped = [p.name for p in scan.incomplete if scan.latest is None or p.name > scan.latest.name]
            notes += [f"{name}: incomplete (no {checkpoint_format.COMPLETE} marker), skipped" for name in skipped]
            if source.name.startswith(checkpoint_format.STEP_PREFIX) and source.is_dir():
                raise checkpoint_format.CheckpointError(
                    f"trainer.resume={source} is incomplete (no {checkpoint_format.COMPLETE} marker): "
                    f"resume from {source.parent} (its newest complete checkpoint) instead"
                )
            if scan.latest is None and scan.incomplete:
                names = ", ".join(p.name for p in scan.incomplete)
                raise checkpoint_format.CheckpointError(
                    f"{source}: no complete checkpoint ({names}: incomplete, no {checkpoint_format.COMPLETE} marker); "
                    f"refusing to start over from step 0: move the incomplete folders away to start over, or set "
                    f"trainer.overwrite=true to move the run aside"
                )
            if scan.latest is None and not auto:
                raise checkpoint_format.CheckpointError(f"trainer.resume={source}: no checkpoint there")
            resume_from = scan.latest
            if resume_from is None:
                notes.append(f"{out}: no checkpoint yet, starting over from step 0")
    start = int(checkpoint_format.read_trainer_state(resume_from)["step"]) if resume_from is not None else 0
    return RunPlan(
        output_dir=out,
        identity=identity,
        resume_from=resume_from,
        start_step=start,
        steps=steps,
        move_aside_to=move_aside_to,
        notes=tuple(notes),
    )


def _refusal(out: Path, reason: str, *, resume: str = "trainer.resume=auto") -> RunDirError:
    return RunDirError(
        f"{out} already holds another run's checkpoints or metrics ({reason}): to continue that run use {resume}; "
        f"to start a new run choose another trainer.output_dir; or set trainer.overwrite=true to move the old run "
        f"aside to {out}.old-<time> (nothing is deleted)"
    )


def _changed_since_last_start(out: Path, cfg: RLConfig) -> list[str]:
    """Config keys that differ from the previous start's resolved config (its config.yaml), if readable."""
    from megatron_rl.config.loader import read_yaml

    try:
        return changed_keys(read_yaml(out / "config.yaml"), to_dict(cfg))
    except Exception:  # noqa: BLE001 - only used to name the differences; the hash already decided
        return []


def _listing(keys: list[str], most: int = 6) -> str:
    if not keys:
        return "see config.yaml there"
    return ", ".join(keys[:most]) + (f" and {len(keys) - most} more" if len(keys) > most else "")


def _inside(path: Path, folder: Path) -> bool:
    return path.absolute().resolve().is_relative_to(folder.absolute().resolve())


def _aside_name(out: Path, now: datetime) -> Path:
    base = out.parent / f"{out.name}.old-{now.astimezone():%Y%m%d-%H%M%S}"
    candidate, n = base, 1
    while candidate.exists():
        candidate, n = base.with_name(f"{base.name}-{n}"), n + 1
    return candidate


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat
