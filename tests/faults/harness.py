"""`megatron-rl train` as a user runs it (a subprocess in its own process group), and what it leaves behind.

The fault tests share one small run: the tiny Qwen3-MoE, no warm-up, a reward with spread in every group
(`fault_rewards.varied`, so the weights move at every step), a checkpoint after every step, two kept.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).parents[2]
EXAMPLE = REPO / "examples" / "tiny_moe_gspo.yaml"
STEPS = 18  # room for 10 kills, each of which lets the run advance a step or two
RUN = (
    "warmup.sft_steps=0",
    "data.eval=null",
    "data.eval_every=0",
    "logging.wandb=false",
    "logging.plot=false",
    "rollout.prompts_per_step=8",
    "rollout.n_samples=4",
    "data.reward=tests.faults.fault_rewards:varied",
    # The reward runs in a worker process that a resumed run starts cold; on a loaded 2-core machine its first calls
    # have exceeded the default 10 s and scored 0 (reward_errors), so the rows differed from the reference's.
    "data.reward_timeout_s=120",
    "trainer.save_every=1",
    "trainer.keep_last=2",
    f"trainer.steps={STEPS}",
)
# Metrics that measure the machine, not the run: they differ between any two runs.
UNTIMED = ("time/", "perf/", "memory/", "sync/", "actor/ppo_kl_first_checked")  # a resumed run verifies its first
# sync and checks its first update against a scoring pass (docs/algorithms.md), as a fresh one does at step 1


def train_command(out: Path, model: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "megatron_rl.cli", "train", str(EXAMPLE), f"trainer.output_dir={out}",
            f"model.hf_path={model}", *RUN, *overrides]  # fmt: skip


class Trainer:
    """One `megatron-rl train` process; its output lines (stdout and stderr) are read as they come."""

    def __init__(self, command: list[str], *, preexec_fn=None):
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            command,
            cwd=REPO,  # data.reward names a module of tests/
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: a signal reaches the checkpoint writers too
            preexec_fn=preexec_fn,
        )
        self.lines: list[tuple[float, str]] = []
        self._new_line = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._new_line:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._new_line.notify_all()
        with self._new_line:
            self._new_line.notify_all()

    def wait_for(self, pattern: str, timeout: float = 300.0) -> re.Match | None:
        """The first output line matching `pattern`, waiting for it; None if the process ended without one."""
        regex, deadline, seen = re.compile(pattern), time.monotonic() + timeout, 0
        with self._new_line:
            while True:
                for _, line in self.lines[seen:]:
                    if match := regex.search(line):
                        return match
                seen = len(self.lines)
                if not self._reader.is_alive():
                    return None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no line matching {pattern!r} after {timeout} s:\n{self.output()[-3000:]}")
                self._new_line.wait(timeout=1.0)

    def seen(self, regex: re.Pattern) -> bool:
        """Whether a line so far matches (no waiting)."""
        with self._new_line:
            return any(regex.search(line) for _, line in self.lines)

    def signal(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float = 600.0) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.signal(signal.SIGKILL)
        self._reader.join(timeout=10)
        return code

    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)


def train(out: Path, model: Path, *overrides: str, preexec_fn=None) -> tuple[int, str]:
    """Run to the end; (exit code, output)."""
    run = Trainer(train_command(out, model, *overrides), preexec_fn=preexec_fn)
    code = run.wait()
    return code, run.output()


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("megatron-rl train: error:")]


def stop_lines(output: str) -> list[str]:
    """The lines of a run that stopped on purpose (a fidelity threshold, a failed weight-sync probe: exit 3)."""
    return [line for line in output.splitlines() if line.startswith("megatron-rl train: stopped:")]


def history(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(UNTIMED)} for r in rows]


def latest(out: Path) -> Path | None:
    pointer = out / "checkpoints" / "latest"
    return out / "checkpoints" / pointer.read_text().strip() if pointer.is_file() else None


def checkpoint_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's model and optimizer state (torch_dist format), read without Megatron."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(
        state, storage_reader=FileSystemReader(str(step_dir / "megatron")), planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )  # fmt: skip
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


@dataclass
class Comparison:
    tensors: int
    bytes_compared: int
    bytes_lost: int  # bytes of the reference's state that are missing or differ
    different: list[str]
    padding: int  # elements of the distributed optimizer's flat buffers that belong to no parameter (not compared)


def compare_checkpoints(got: Path, expected: Path) -> Comparison:
    """Bitwise: model weights, the optimizer's main params and Adam moments, and the trainer state (schedule,
    Adam step, data position) and RNG. Megatron saves the distributed optimizer's state as flat buffers whose
    alignment padding between parameters is uninitialised memory (different in every save): only the elements
    of a parameter are compared, located by finding each weight in the reference's fp32 main-param buffer."""
    a, b = checkpoint_tensors(got), checkpoint_tensors(expected)
    real = {name: _parameter_elements(buf, b) for name, buf in b.items() if name.endswith(".param")}
    different, lost, compared, padding = [], 0, 0, 0
    for name, ref in b.items():
        mine = a.get(name)
        mask = real.get(name.rsplit(".", 1)[0] + ".param") if name.startswith("optimizer.") else None
        if mask is not None and mine is not None and mine.shape == ref.shape:
            padding += int((~mask).sum())
            mine, ref = mine[mask], ref[mask]
        size = ref.numel() * ref.element_size()
        compared += size
        if mine is None or not _same(mine, ref):
            different.append(name)
            lost += size
    different += sorted(set(a) - set(b))

    def state(path: Path) -> dict:
        """The trainer state without what differs between two runs of the same training: the run id and the wall
        times in the step's metrics row (its training metrics must be equal)."""
        saved = json.loads((path / "trainer_state.json").read_text())
        trainer = dict(saved["trainer"])
        if trainer.get("metrics_row"):
            trainer["metrics_row"] = comparable([trainer["metrics_row"]])[0]
        return {**{k: v for k, v in saved.items() if k != "run_id"}, "trainer": trainer}

    if state(got) != state(expected):
        different.append("trainer_state.json")
    for rng in sorted((expected / "rng").glob("*.pt")):
        x, y = torch.load(got / "rng" / rng.name, weights_only=True), torch.load(rng, weights_only=True)
        if not _same(x, y):
            different.append(f"rng/{rng.name}")
    return Comparison(len(b), compared, lost, different, padding)


def _parameter_elements(flat: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mask of the elements of a flat fp32 main-param buffer that hold a model weight (a stacked expert weight
    `[experts, ...]` is found expert by expert)."""
    mask = torch.zeros_like(flat, dtype=torch.bool)
    for name, weight in tensors.items():
        if name.startswith("optimizer.") or weight.dtype != flat.dtype:
            continue
        for part in weight.unbind(0) if weight.dim() == 3 else (weight,):
            values = part.reshape(-1)
            for start in (flat == values[0]).nonzero().flatten().tolist():
                if torch.equal(flat[start : start + values.numel()], values):
                    mask[start : start + values.numel()] = True
    return mask


def _same(x, y) -> bool:
    """Bitwise equal (NaN == NaN, 0.0 != -0.0), through dicts."""
    if isinstance(x, torch.Tensor):
        return (
            isinstance(y, torch.Tensor)
            and x.dtype == y.dtype
            and x.shape == y.shape
            and torch.equal(x.contiguous().view(-1).view(torch.uint8), y.contiguous().view(-1).view(torch.uint8))
        )
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    return x == y


def all_finite(step_dir: Path) -> bool:
    """Every model weight and every optimizer value that belongs to a parameter is finite. The distributed
    optimizer's alignment padding is uninitialised memory (see `compare_checkpoints`): it may hold a NaN."""
    tensors = checkpoint_tensors(step_dir)
    real = {name: _parameter_elements(buf, tensors) for name, buf in tensors.items() if name.endswith(".param")}
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            continue
        mask = real.get(name.rsplit(".", 1)[0] + ".param") if name.startswith("optimizer.") else None
        values = tensor[mask] if mask is not None and mask.shape == tensor.shape else tensor
        if not bool(torch.isfinite(values).all()):
            return False
    return True
