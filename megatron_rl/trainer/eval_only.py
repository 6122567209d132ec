"""`megatron-rl eval`: a run's evaluation (`data.eval`) of any model or checkpoint, with the code `train` runs.

The policy is built as `train` builds it (any parallel layout, under torchrun too), loaded from the checkpoint,
synced into the run's rollout engine (local or SGLang) and scored by the same `Evaluator`, seeded by the
checkpoint's step: in sync mode with the same engine, the numbers are the run's at that step. Results go to
`eval_results.json`, `eval_results.md` and `eval_samples.jsonl` in the output folder.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_rl.config.schema import RLConfig
from megatron_rl.evaluation.runner import Evaluator
from megatron_rl.formats.checkpoint_format import is_complete, latest_checkpoint
from megatron_rl.jsonl import replace_jsonl
from megatron_rl.megatron_backend import platform
from megatron_rl.megatron_backend.checkpoint import dist_checkpoint as checkpoints
from megatron_rl.megatron_backend.distributed import shutdown
from megatron_rl.models.architecture import max_positions, model_dims
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.rollout.engines.engine_factory import build_engine
from megatron_rl.trainer.colocation import ColocatedMemory
from megatron_rl.trainer.guards.input_guards import check_positions
from megatron_rl.trainer.logs.sample_log import eval_rows
from megatron_rl.trainer.loop import build_actor, init_process_groups, load_tokenizer, prepare_model_dir
from megatron_rl.trainer.rollout_phase import NoEngine, WeightSync, engine_run, prompt_data, serve_side_models

RESULTS_JSON = "eval_results.json"
RESULTS_MD = "eval_results.md"
SAMPLES_JSONL = "eval_samples.jsonl"


@dataclass
class EvalResult:
    step: int  # the checkpoint's RL step (0: an HF model)
    metrics: dict[str, float]  # eval/... and time/eval/... as a run logs them (empty on ranks other than 0)
    output_dir: Path
    files: list[Path]


@dataclass(frozen=True)
class CheckpointSource:
    """What `--checkpoint` names: an HF model folder (`hf`), a Megatron checkpoint of a run (`megatron`), or
    nothing (`model`: the config's model.hf_path)."""

    kind: str
    path: Path | None
    label: str  # the output folder's name: the checkpoint's folder name


def find_checkpoint(path: str | Path | None) -> CheckpointSource:
    """Classify `--checkpoint`: a folder with config.json is an HF model; a complete Megatron checkpoint, a run's
    `checkpoints/` folder or a run folder give the (newest) Megatron checkpoint. ValueError naming what was looked
    for otherwise."""
    if path is None:
        return CheckpointSource("model", None, "model")
    path = Path(path)
    if not path.exists():
        raise ValueError(f"--checkpoint {path}: no such file or folder")
    if (path / "config.json").is_file():
        return CheckpointSource("hf", path, path.name)
    for candidate in (path, path / "checkpoints"):
        found = candidate if is_complete(candidate) else latest_checkpoint(candidate) if candidate.is_dir() else None
        if found is not None:
            return CheckpointSource("megatron", found, found.name)
    raise ValueError(
        f"--checkpoint {path} is neither a Hugging Face model folder (config.json) nor a complete checkpoint of a run "
        "(a step_* folder with COMPLETE, a run's checkpoints/ folder or the run folder)"
    )


def default_output_dir(cfg: RLConfig, source: CheckpointSource) -> Path:
    """A run's checkpoint: `<run folder>/eval/<step folder>`; otherwise `<trainer.output_dir>/eval/<name>`."""
    if source.kind == "megatron" and source.path is not None and source.path.parent.name == "checkpoints":
        return source.path.parent.parent / "eval" / source.label
    return Path(cfg.trainer.output_dir) / "eval" / source.label


def evaluate_checkpoint(
    cfg: RLConfig, checkpoint: str | Path | None = None, *, output_dir: str | Path | None = None
) -> EvalResult:
    """Score the config's evaluation datasets on `checkpoint` (`find_checkpoint`; None: model.hf_path)."""
    if not cfg.data.eval_sets():
        raise ValueError("megatron-rl eval needs evaluation datasets: set data.eval (a file, a built-in task, a list)")
    source = find_checkpoint(checkpoint)
    if source.kind == "hf":  # the model's weights from the folder; the run's tokenizer
        tokenizer_path = cfg.model.tokenizer_path or cfg.model.hf_path
        cfg = replace(cfg, model=replace(cfg.model, hf_path=str(source.path), tokenizer_path=tokenizer_path))
    out = Path(output_dir) if output_dir is not None else default_output_dir(cfg, source)
    platform.bridge_cpu()
    model_dir = prepare_model_dir(cfg)
    hf = read_hf_config(model_dir)
    dims = model_dims(hf)
    init_process_groups(cfg, dims)
    engine: Any = NoEngine()
    side_servers = ExitStack()
    try:
        rank0 = dist.get_rank() == 0
        cfg = serve_side_models(cfg, side_servers)  # a judge named side:<name>, as `train` resolves it
        tokenizer = load_tokenizer(cfg, dims.vocab_size)
        data = prompt_data(cfg, tokenizer)
        check_positions(cfg, data, max_positions(hf))
        evaluator = Evaluator(data, tokenizer)  # an unknown reward is refused before the model is built
        actor = build_actor(cfg, model_dir)
        step = 0
        if source.kind == "megatron" and source.path is not None:
            step = int(checkpoints.load_checkpoint(actor, source.path, load_optimizer=False)["step"])
        engine = build_engine(cfg.rollout, engine_run(cfg), model_dir, platform.device()) if rank0 else NoEngine()
        memory = ColocatedMemory(
            actor, engine, offload_actor=cfg.trainer.offload_actor, release_engine=cfg.rollout.release_memory
        )
        memory.for_training()
        memory.for_weight_sync()
        WeightSync(actor, engine, cfg.rollout).send(step)  # as `train` sends the weights it evaluates
        memory.for_rollout()
        metrics: dict[str, float] = {}
        files: list[Path] = []
        if rank0:
            rows: list[dict[str, Any]] = []
            keep = lambda name, samples: rows.extend(eval_rows(step, samples, tokenizer, name))  # noqa: E731
            metrics = evaluator.evaluate(engine, step, on_samples=keep)
            files = write_results(out, step, source, metrics, rows, evaluator)
        dist.barrier()
        return EvalResult(step, metrics, out, files)
    finally:
        engine.shutdown()
        side_servers.close()
        shutdown()


def write_results(
    out: Path, step: int, source: CheckpointSource, metrics: dict[str, float], rows: list[dict], evaluator: Evaluator
) -> list[Path]:
    """eval_results.json (every metric), eval_results.md (a table: a row per dataset) and eval_samples.jsonl."""
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "step": step,
        "checkpoint": str(source.path) if source.path is not None else None,
        "kind": source.kind,
        "metrics": metrics,
    }
    (out / RESULTS_JSON).write_text(json.dumps(record, indent=1) + "\n")
    (out / RESULTS_MD).write_text(results_table(metrics, [(ds.name, ds.prefix) for ds in evaluator.datasets]) + "\n")
    replace_jsonl(out / SAMPLES_JSONL, rows)
    return [out / RESULTS_JSON, out / RESULTS_MD, out / SAMPLES_JSONL]


# The last columns of eval_results.md (before them: accuracy, mean@n, pass@k and maj@k by k).
_LAST = ("response_length", "truncation_rate", "problems", "samples")


def results_table(metrics: dict[str, float], datasets: list[tuple[str, str]]) -> str:
    """A markdown table of `metrics`: a row per dataset (name, metric-key prefix), a column per metric."""
    per: dict[str, dict[str, float]] = {}
    for name, prefix in datasets:
        own = {k[len(prefix) :]: v for k, v in metrics.items() if k.startswith(prefix)}
        per[name] = {k: v for k, v in own.items() if "/" not in k and k not in ("weight_version", "skipped")}
    names = {m for values in per.values() for m in values if m != "reward_mean"}
    columns = sorted(names, key=_column_order)
    lines = ["| dataset | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for name, values in per.items():
        cells = [_cell(values.get(c), c) for c in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _column_order(metric: str) -> tuple[int, str, int]:
    head, _, k = metric.partition("@")
    families = ["accuracy", "mean", "pass", "maj", *_LAST]
    rank = families.index(head) if head in families else len(families)
    return rank, head, int(k) if k.isdigit() else 0


def _cell(value: float | None, metric: str) -> str:
    if value is None:
        return ""
    return f"{value:.0f}" if metric in ("problems", "samples") else f"{value:.3f}"
