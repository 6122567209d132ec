"""The Python entry point: `train(config)` runs what `megatron-rl train CONFIG [key=value ...]` runs.

    from megatron_rl import ModelConfig, RLConfig, TrainerConfig, train
    result = train(RLConfig(model=ModelConfig(hf_path="models/tiny"), trainer=TrainerConfig(steps=2)))
    result = train("examples/tiny_moe_gspo.yaml", ["trainer.steps=2"])   # a YAML file and overrides
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rl.config import RLConfig, check_input_paths, load_config
from megatron_rl.config.loader import configure
from megatron_rl.rollout.plugin_check import check_plugins

if TYPE_CHECKING:
    from megatron_rl.trainer.eval_only import EvalResult
    from megatron_rl.trainer.loop import TrainResult


def train(config: RLConfig | str | Path, overrides: Sequence[str] = (), *, verbose: bool = False) -> TrainResult:
    """Run (or continue: `trainer.resume=auto`) the run in `trainer.output_dir`.

    `config` is an `RLConfig` built in Python (resolved as `megatron_rl.config.loader.configure` says: a preset
    fills the algo keys left at their defaults) or a YAML file; `overrides` are dotted `key=value` strings on top.
    Inputs and every plugin the config names are checked before anything is built. A Ctrl-C / SIGTERM stops at the
    next step boundary (`TrainResult.stopped_by`); outside one it raises `TrainingAborted` (a BaseException)."""
    if isinstance(config, RLConfig):
        cfg, config_path = configure(config, overrides), None
    else:
        cfg, config_path = load_config(config, overrides), str(config)
    check_input_paths(cfg)  # model, tokenizer and data files exist: fail before the model is built
    check_plugins(cfg.data, cfg.rollout)
    from megatron_rl.trainer.logs.run_dir import resume_command
    from megatron_rl.trainer.loop import train as run_training

    return run_training(cfg, resume_command=resume_command(cfg, config_path, overrides), verbose=verbose)


def evaluate(
    config: RLConfig | str | Path,
    overrides: Sequence[str] = (),
    *,
    checkpoint: str | Path | None = None,
    output_dir: str | Path | None = None,
) -> EvalResult:
    """What `megatron-rl eval` runs: the config's evaluation datasets (`data.eval`) scored on `checkpoint` (an HF
    model folder, a run's checkpoint or run folder; None: model.hf_path), as `train` scores them."""
    if isinstance(config, RLConfig):
        cfg = configure(config, overrides)
    else:
        cfg = load_config(config, overrides)
    check_input_paths(cfg)
    check_plugins(cfg.data, cfg.rollout)
    from megatron_rl.trainer.eval_only import evaluate_checkpoint

    return evaluate_checkpoint(cfg, checkpoint, output_dir=output_dir)
