"""The supervised warm-up (SFT): `warmup.sft_steps` steps on prompt -> response examples before RL, or alone
(`megatron-rl sft`).

The examples come from `PromptData.sft_pairs` (a built-in task's SFT split, or the user's rows through
`rollout.sft_data`); example k of the stream depends on the seed and k only, so a warm-up resumed at step k
continues with the examples it would have drawn. Each step's NLL goes to `sft_metrics.jsonl` (and `sft_nll.png`);
every `warmup.save_every` steps, and at a stop with `trainer.save_on_interrupt`, a checkpoint of RL step 0 holds
the model, the optimizer and `sft_step`, from which a resumed run continues the warm-up.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.config.schema import RLConfig
from megatron_rl.megatron_backend.actor.batch import TokenBatch
from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
from megatron_rl.megatron_backend.checkpoint import dist_checkpoint as checkpoint
from megatron_rl.trainer.guards.stop_signals import StopSignals
from megatron_rl.trainer.run_state import RunState

SFT_METRICS = "sft_metrics.jsonl"  # one row per warm-up step: sft_step, sft/nll, sft/tokens, time/sft_step
SFT_PLOT = "sft_nll.png"


@dataclass
class WarmupRun:
    """Where a warm-up reports and checkpoints. `stop` (None: no signal handling) stops it at a step boundary."""

    output_dir: Path
    checkpoint_root: Path
    run_id: str | None
    stop: StopSignals | None = None
    stopped_by: int | None = None  # set when a signal stopped the warm-up


def supervised_warmup(
    cfg: RLConfig,
    actor: MegatronActor,
    data: Any,
    *,
    first_step: int = 0,
    after_step: Callable[[int, dict[str, float]], bool] | None = None,
) -> int:
    """Warm-up steps `first_step + 1` .. `warmup.sft_steps` at `warmup.sft_lr` (the RL stage's LR schedule does not
    move). `after_step(k, metrics)` runs after step k on every rank; True stops the warm-up there. Returns the
    last step done. Multi-turn examples train their model turns only (`loss_mask`)."""
    from tqdm import tqdm

    w = cfg.warmup
    bar = tqdm(
        range(first_step, w.sft_steps),
        desc="supervised warm-up",
        initial=first_step,
        total=w.sft_steps,
        disable=dist.get_rank() != 0,
    )
    for k in bar:
        t = time.perf_counter()
        pairs = data.sft_pairs(w.sft_batch_size, start=k * w.sft_batch_size)
        metrics = actor.warmup_step(pairs_to_batch(pairs), sft_loss, lr=w.sft_lr)
        metrics["time/sft_step"] = time.perf_counter() - t
        metrics["sft/tokens"] = float(sum(sum(p.loss_mask or [1] * len(p.response_ids)) for p in pairs))
        bar.set_postfix(nll=f"{metrics['sft/nll']:.3f}")
        if after_step is not None and after_step(k + 1, metrics):
            bar.close()
            return k + 1
    return w.sft_steps


def run_warmup(cfg: RLConfig, actor: MegatronActor, data: Any, state: RunState, where: WarmupRun) -> bool:
    """Collective. The warm-up from `state.sft_step` (0 for a fresh run) with its metrics rows and mid-SFT
    checkpoints (see the module docstring). False when a signal stopped it (checkpointed as asked)."""
    rank0 = dist.get_rank() == 0
    first = state.sft_step
    log = SFTLog(where.output_dir, first_step=first) if rank0 else None
    every = cfg.warmup.save_every
    last_saved = first if first else None
    stop = where.stop
    if stop is not None:
        stop.armed = True  # a Ctrl-C / SIGTERM stops at the next warm-up step boundary

    def save(k: int) -> None:
        sft_state = RunState(sft_step=k, data=data_state(data)).saved()
        what = f"checkpoint of SFT step {k}"
        with stop.writing(what) if stop is not None else nullcontext():
            checkpoint.save_checkpoint(
                actor,
                where.checkpoint_root,
                0,
                sft_state,
                keep_last=cfg.trainer.keep_last or 10**9,
                run_id=where.run_id,
            )

    def after_step(k: int, metrics: dict[str, float]) -> bool:
        nonlocal last_saved
        if log is not None:
            log.log(k, metrics)
        if every and k % every == 0 and k < cfg.warmup.sft_steps:
            save(k)
            last_saved = k
        signum = stop.agreed() if stop is not None and k < cfg.warmup.sft_steps else None
        if signum is None:
            return False
        save_now = cfg.trainer.save_on_interrupt and last_saved != k
        if save_now:
            save(k)
            last_saved = k
        where.stopped_by = signum
        if rank0 and stop is not None:
            kept = "none (a resume starts the warm-up over)" if last_saved is None else f"SFT step {last_saved}"
            print(
                f"interrupted at SFT step {k} of {cfg.warmup.sft_steps}; last checkpoint: {kept}; resume with: "
                f"{stop.resume_command}",
                flush=True,
            )
        return True

    done = supervised_warmup(cfg, actor, data, first_step=first, after_step=after_step)
    if log is not None:
        log.close(plot=cfg.logging.plot)
    return done == cfg.warmup.sft_steps and where.stopped_by is None


def check_warmup_data(source: Any, max_tokens: int) -> None:
    """Refuse an example of the warm-up's `source` (read by now: a bad row was refused) longer than the model's
    `max_tokens` positions. The built-in tasks' examples are short by construction."""
    if hasattr(source, "check_lengths"):
        source.check_lengths(max_tokens)


def data_state(data: Any) -> Any:
    """The prompt stream's position to keep in a mid-SFT checkpoint (None for a bare SFT source)."""
    return data.state_dict() if hasattr(data, "state_dict") else None


class SFTLog:
    """`sft_metrics.jsonl` (rank 0): rows after `first_step` are cut (a resumed warm-up writes them again)."""

    def __init__(self, output_dir: Path, *, first_step: int = 0):
        self.path = output_dir / SFT_METRICS
        self.rows = [r for r in read_sft_metrics(self.path) if r["sft_step"] <= first_step]
        output_dir.mkdir(parents=True, exist_ok=True)
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
        self._file = self.path.open("a")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"sft_step": step, **{k: float(v) for k, v in metrics.items() if k.startswith(("sft/", "time/"))}}
        self.rows.append(row)
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self, *, plot: bool) -> Path | None:
        self._file.close()
        return plot_sft_nll(self.rows, self.path.parent / SFT_PLOT) if plot and self.rows else None


def read_sft_metrics(path: Path) -> list[dict[str, float]]:
    """The rows of an `sft_metrics.jsonl` (none if it does not exist); a torn last line is dropped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash: the resumed warm-up writes that step again
        if isinstance(row, dict) and isinstance(row.get("sft_step"), int):
            rows.append(row)
    return rows


def plot_sft_nll(rows: list[dict[str, float]], path: Path) -> Path:
    """The warm-up's NLL per step as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot([r["sft_step"] for r in rows], [r["sft/nll"] for r in rows], label="sft/nll")
    ax.set_xlabel("SFT step")
    ax.set_ylabel("NLL per trained token")
    ax.set_title("supervised warm-up")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def pairs_to_batch(pairs: list) -> TokenBatch:
    """Right-padded prompt + response rows; `fields["loss_mask"]` is 1 on the response tokens that train (all of
    them, or where a pair's `loss_mask` is 1: multi-turn observations and the user turns of a chat do not train)."""
    lengths = [len(p.prompt_ids) + len(p.response_ids) for p in pairs]
    ids = torch.zeros(len(pairs), max(lengths), dtype=torch.long)
    loss_mask = torch.zeros(len(pairs), max(lengths))
    for i, p in enumerate(pairs):
        ids[i, : lengths[i]] = torch.tensor(p.prompt_ids + p.response_ids)
        start = len(p.prompt_ids)
        loss_mask[i, start : lengths[i]] = 1.0 if p.loss_mask is None else torch.tensor(p.loss_mask, dtype=torch.float)
    starts = torch.tensor([len(p.prompt_ids) for p in pairs])
    return TokenBatch(ids, torch.tensor(lengths), starts, fields={"loss_mask": loss_mask})


def sft_loss(log_probs: torch.Tensor, entropy: torch.Tensor | None, mb: TokenBatch):
    """The warm-up's loss (`batch.LossFn`): mean negative log-likelihood of the trained response tokens
    (`fields["loss_mask"]` of `pairs_to_batch`)."""
    mask = mb.fields["loss_mask"].to(log_probs.device)
    count = mask.sum().to(torch.int)
    nll = -(log_probs * mask).sum()
    return nll, count, {"sft/nll": float(nll.detach() / count.clamp(min=1))}
