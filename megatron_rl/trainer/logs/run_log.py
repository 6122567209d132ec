"""Where a run reports: a line per step with ETA, `metrics.jsonl`, wandb (offline without an API key),
TensorBoard, the samples files (`sample_log`), and PNG plots of the curves people look at (`plots`)."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from megatron_rl.config.schema import LoggingConfig, RLConfig
from megatron_rl.jsonl import records_before_step, replace_jsonl
from megatron_rl.models.family import ModelDims
from megatron_rl.trainer.logs.plots import eval_headlines, series_label, write_plots
from megatron_rl.trainer.logs.sample_log import SampleLog, wandb_table

logger = logging.getLogger(__name__)


def restore_history(path: Path, first_step: int) -> list[dict[str, float]]:
    """Cut `metrics.jsonl` back to the rows before `first_step` (the first step this start logs) and return them.

    A resumed run logs again from its checkpoint's step + 1, so later rows (written after the checkpoint by a
    start that crashed or was interrupted) go; a row cut off by a crash is dropped; each step is kept once (the
    last row written for it), in step order. The file is replaced atomically."""
    rows = {record["step"]: record for record in records_before_step(path, first_step)}  # the last row of a step
    kept = [rows[step] for step in sorted(rows)]
    if path.is_file():
        replace_jsonl(path, kept)
    return kept


def run_header(cfg: RLConfig, dims: ModelDims, resumed_from: Path | None, start_step: int) -> str:
    """What a run is, in a few lines (printed at start-up; the full resolved config is in output_dir/config.yaml)."""
    a, r, p, t = cfg.algo, cfg.rollout, cfg.parallel, cfg.trainer
    moe = f"{len(dims.moe_layers)} MoE layers x {dims.num_experts} experts, top-{dims.top_k}"
    kl = f", KL {a.kl_estimator} x {a.kl_coef:g}" if a.kl_coef > 0 else ""
    layout = " ".join(f"{k}={getattr(p, k)}" for k in ("tp", "pp", "ep", "cp") if getattr(p, k, 1) != 1) or "1 process"
    where = f"resumed from {resumed_from} at step {start_step}" if resumed_from is not None else "new run"
    mode = f"async (max staleness {t.max_staleness})" if t.mode == "async" else "sync"
    return "\n".join(
        [
            f"megatron-rl train: {a.preset if a.preset != 'none' else a.loss} | {t.steps} steps | {where}",
            f"  model   {cfg.model.hf_path} ({dims.model_type}, {dims.num_layers} layers, hidden {dims.hidden_size}, "
            f"{moe})",
            f"  algo    loss {a.loss}, agg {a.agg}, clip {a.clip_low:g}/{a.clip_high:g}, advantage {a.advantage}{kl}, "
            f"routing replay {a.routing_replay}",
            f"  rollout {mode}, {r.engine} engine, {r.prompts_per_step} prompts x {r.n_samples} samples, "
            f"{r.sampling.max_new_tokens} new tokens; layout {layout}",
            f"  output  {t.output_dir} (full config: config.yaml; --verbose prints it)",
        ]
    )


class RunLog:
    """Collects metrics of one run (rank 0 only) and fans them out.

    `first_step` is the first step this start logs: rows from it on are cut from metrics.jsonl (a resumed run
    redoes them), earlier rows are loaded into `history` so plots and summaries cover the whole run; TensorBoard
    drops its events from `first_step` on, and wandb continues the run `wandb_id` (stable across resumes).
    `samples` (built with the same `first_step`) holds the steps' sample rows: written with the step's metrics,
    logged as the wandb tables `samples` / `eval_samples`, and the `logging.show_samples` excerpt printed after
    the step line."""

    def __init__(
        self,
        cfg: LoggingConfig,
        output_dir: Path,
        total_steps: int,
        run_config: dict[str, Any],
        *,
        first_step: int = 0,
        wandb_id: str | None = None,
        samples: SampleLog | None = None,
    ):
        self.cfg = cfg
        self.samples = samples
        self.output_dir = output_dir
        self.total_steps = total_steps
        self.history: list[dict[str, float]] = restore_history(output_dir / "metrics.jsonl", first_step)
        self._jsonl = (output_dir / "metrics.jsonl").open("a")
        self._start = time.monotonic()
        self._first_step: int | None = None
        self._wandb = self._init_wandb(run_config, wandb_id) if cfg.wandb else None
        self._tb = self._init_tensorboard(first_step) if cfg.tensorboard else None

    def _init_wandb(self, run_config: dict[str, Any], run_id: str | None):
        mode = self.cfg.resolved_wandb_mode(os.environ)
        if mode == "disabled":
            return None
        try:
            import wandb
        except ImportError:
            logger.warning("wandb is not installed; metrics go to metrics.jsonl only")
            return None
        return wandb.init(
            project=self.cfg.wandb_project,
            name=self.cfg.wandb_run_name or self.output_dir.name,
            dir=str(self.output_dir),
            mode=mode,
            config=run_config,
            id=run_id,
            resume="allow" if run_id else None,
            settings=wandb.Settings(silent=True),
        )

    def _init_tensorboard(self, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(self.output_dir / "tensorboard"), purge_step=first_step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        tables, excerpt = self.samples.take(step) if self.samples is not None else ({}, "")
        self._write(step, metrics, tables)
        if self._first_step is None:
            self._first_step, self._start = step, time.monotonic()
        if step % self.cfg.log_every == 0 or step == self.total_steps:
            print(self.format_line(step, metrics), flush=True)
        if excerpt:
            print(excerpt, flush=True)

    def restore_row(self, step: int, metrics: dict[str, float]) -> bool:
        """Log `step`'s row kept in its checkpoint when metrics.jsonl lacks it (the run died between publishing the
        checkpoint and writing the row); a resumed run starts after that step, so it would never be written again.
        Returns whether the row was missing."""
        if any(r["step"] == step for r in self.history):
            return False
        self._write(step, metrics)
        return True

    def _write(self, step: int, metrics: dict[str, float], tables: dict[str, list[dict]] | None = None) -> None:
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self.history.append(record)
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._wandb is not None:
            import wandb

            logged: dict[str, Any] = dict(metrics)
            for name, rows in (tables or {}).items():
                columns, data = wandb_table(rows)
                # mixed types allowed: a column (an answer, a data_source) may hold text in one row, a number in another
                logged[name] = wandb.Table(columns=columns, data=data, allow_mixed_types=True)
            self._wandb.log(logged, step=step)
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)

    def format_line(self, step: int, m: dict[str, float]) -> str:
        done = step - (self._first_step or step) + 1
        per_step = (time.monotonic() - self._start) / max(done - 1, 1) if done > 1 else m.get("time/step", 0.0)
        eta = per_step * (self.total_steps - step)
        parts = [f"step {step}/{self.total_steps}"]
        for key, label, fmt in (
            ("rollout/reward_mean", "reward", ".3f"),
            ("eval/accuracy", "eval_acc", ".3f"),
            ("actor/pg_loss", "loss", ".4f"),
            ("actor/ppo_kl", "ppo_kl", ".2e"),
            ("actor/ppo_kl_first", "kl0", ".0e"),
            ("actor/kl_ref", "kl_ref", ".2e"),  # the KL to the reference (only with algo.kl_coef > 0)
            ("actor/clip_frac_high", "clip", ".3f"),
            ("actor/grad_norm", "gnorm", ".3f"),
            ("mismatch/logp_abs_diff", "mismatch", ".1e"),
            ("routing/agreement", "route_agree", ".3f"),
            ("time/step", "s/step", ".1f"),
        ):
            if key in m and math.isfinite(m[key]):
                parts.append(f"{label} {m[key]:{fmt}}")
            if key == "eval/accuracy":  # then each evaluation dataset's headline: "gsm8k mean@4 0.412"
                headlines = eval_headlines(k for k, v in m.items() if math.isfinite(v))
                parts += [f"{series_label(k)} {m[k]:.3f}" for k in headlines.values()]
        parts.append(f"eta {_duration(eta)}")
        return " | ".join(parts)

    def close(self) -> list[Path]:
        """Flush everything; write plots. Returns the PNG paths."""
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        return self.plot() if self.cfg.plot else []

    def plot(self) -> list[Path]:
        """The PNGs of `plots.PLOTS` over the whole history (earlier starts' steps included); the paths written."""
        return write_plots(self.history, self.output_dir)


def _duration(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    return f"{seconds // 60}m{seconds % 60:02d}s"
