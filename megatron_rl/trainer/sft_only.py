"""`megatron-rl sft`: the warm-up of `train` run alone, without RL steps (the same code: `warmup.run_warmup`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from megatron_rl.config.schema import RLConfig
from megatron_rl.megatron_backend import platform
from megatron_rl.megatron_backend.checkpoint import dist_checkpoint as checkpoint
from megatron_rl.megatron_backend.distributed import decided_on_rank0, shutdown
from megatron_rl.megatron_backend.weights.hf_export import save_hf_checkpoint
from megatron_rl.models.architecture import max_positions, model_dims
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.rollout.data import open_sft_source
from megatron_rl.trainer.guards.stop_signals import StopSignals
from megatron_rl.trainer.logs import run_dir
from megatron_rl.trainer.loop import WARMUP_MODEL, build_actor, init_process_groups, load_tokenizer, prepare_model_dir
from megatron_rl.trainer.run_state import RunState
from megatron_rl.trainer.warmup import SFT_METRICS, WarmupRun, check_warmup_data, read_sft_metrics, run_warmup


@dataclass
class SFTResult:
    output_dir: Path
    model_dir: Path | None  # the SFT model in HF format (None: stopped before the last step)
    rows: list[dict[str, float]]  # sft_metrics.jsonl, earlier starts' rows included
    stopped_by: int | None = None  # the signal that stopped the warm-up at a step boundary


def sft(cfg: RLConfig, *, resume_command: str | None = None) -> SFTResult:
    """`megatron-rl sft`: the warm-up of `train` without RL, in `trainer.output_dir` (resumable from its mid-SFT
    checkpoints); the model goes to `<output_dir>/warmup_model` in HF format, for `model.hf_path` of an RL run."""
    if cfg.warmup.sft_steps < 1:
        raise ValueError("megatron-rl sft needs warmup.sft_steps >= 1 (how many SFT steps), e.g. warmup.sft_steps=200")
    output_dir = Path(cfg.trainer.output_dir)
    run_dir.check_output_dir(output_dir)
    platform.bridge_cpu()
    checkpoint.start_checkpoint_writer()
    command = resume_command or run_dir.resume_command(cfg, None).replace("megatron-rl train ", "megatron-rl sft ", 1)
    with StopSignals(command) as stop:
        model_dir = prepare_model_dir(cfg)
        hf = read_hf_config(model_dir)
        dims = model_dims(hf)
        init_process_groups(cfg, dims)
        rank0 = stop.announce = dist.get_rank() == 0
        try:
            plan = decided_on_rank0(lambda: run_dir.plan_run(cfg))
            if rank0:
                run_dir.start_run(plan)
            dist.barrier()
            tokenizer = load_tokenizer(cfg, dims.vocab_size)
            source = open_sft_source(cfg.warmup, cfg.data, cfg.trainer.seed, tokenizer)
            check_warmup_data(source, max_positions(hf))
            actor = build_actor(cfg, model_dir)
            state = RunState()
            if plan.resume_from is not None:
                state = RunState.from_saved(checkpoint.load_checkpoint(actor, plan.resume_from))
                if state.sft_done:
                    raise ValueError(
                        f"{output_dir} holds an RL run past its warm-up (checkpoint {plan.resume_from.name}): "
                        "megatron-rl sft needs a folder of its own; set trainer.output_dir to another folder"
                    )
            where = WarmupRun(output_dir, plan.checkpoint_root, plan.identity.run_id, stop)
            done = run_warmup(cfg, actor, source, state, where)
            model_out = None
            if done:
                model_out = save_hf_checkpoint(
                    actor, output_dir / WARMUP_MODEL, model_dir, bucket_mb=cfg.rollout.bucket_mb
                )
            rows = read_sft_metrics(output_dir / SFT_METRICS) if rank0 else []
            return SFTResult(output_dir, model_out, rows, stopped_by=where.stopped_by)
        finally:
            shutdown()

