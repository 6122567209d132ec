"""A LoRA run's checkpoint (adapters only) -> a peft adapter directory and, on request, the merged HF model.

The adapters load into the one-process layout (their checkpoint declares every split), on the base the run
trained (`model.hf_path` of its `config.yaml`, or `base`); the adapter is written in peft's format
(`peft_format.py`), the merged model as `W + (α/r) B A` through the actor's HF export."""

from __future__ import annotations

from pathlib import Path

from megatron_rl.formats.checkpoint_format import resolve_checkpoint_dir
from megatron_rl.megatron_backend.lora.checkpoint import LoRARun, lora_run


def lora_to_hf(checkpoint: str | Path, out_dir: str | Path, *, base: str | Path | None = None,
               merged: str | Path | None = None) -> LoRARun:  # fmt: skip
    """Write the adapters of a LoRA run's `checkpoint` as a peft adapter in `out_dir` and, with `merged`, the
    merged model there. `base`: the base HF model (default: the run's `model.hf_path`)."""
    from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
    from megatron_rl.megatron_backend.checkpoint.dist_checkpoint import load_checkpoint
    from megatron_rl.megatron_backend.lora.peft_format import save_peft_adapter
    from megatron_rl.megatron_backend.weights.conversion import single_process_megatron
    from megatron_rl.megatron_backend.weights.hf_export import save_hf_checkpoint
    from megatron_rl.parallel_layout import ParallelLayout

    path = resolve_checkpoint_dir(checkpoint)
    run = lora_run(path)
    if run is None:
        raise ValueError(
            f"{path} is not a LoRA run's checkpoint (its run's config.yaml has no model.lora.rank > 0): convert it "
            "with `megatron-rl convert megatron-to-hf`"
        )
    base_dir = Path(base) if base is not None else run.base
    if not (base_dir / "config.json").is_file():
        raise FileNotFoundError(f"the base model {base_dir} (config.json) is not there: pass --base HF_DIR")
    with single_process_megatron():
        actor = MegatronActor.from_hf(base_dir, ParallelLayout(), lora=run.lora)
        load_checkpoint(actor, path, load_optimizer=False)
        experts = actor.family.weight_map(actor.hf_config).num_experts
        save_peft_adapter(actor.chunks, run.lora, experts, Path(out_dir), str(base_dir))
        if merged is not None:
            save_hf_checkpoint(actor, merged, base_dir)
    return LoRARun(base_dir, run.lora)
