"""Write the actor's weights as a Hugging Face checkpoint directory (safetensors shards + index).

Streams `MegatronActor.export_hf` buckets: each bucket becomes one shard, so host memory stays at one
bucket. Rank 0 writes into a temporary directory that is renamed when complete; config, generation
config and tokenizer files are copied from the source HF directory.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch.distributed as dist

from megatron_rl.megatron_backend.actor import MegatronActor
from megatron_rl.megatron_backend.conversion import HF_EXTRA_FILES

COPIED_FILES = ("config.json", *HF_EXTRA_FILES)


def save_hf_checkpoint(actor: MegatronActor, out_dir: str | Path, source_dir: str | Path, *, bucket_mb: int = 2048):
    """Collective. Returns the written directory."""
    from safetensors.torch import save_file

    out, source = Path(out_dir), Path(source_dir)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    tmp = out.with_name(f".tmp_{out.name}")
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    total = 0
    for index, bucket in enumerate(actor.export_hf(bucket_bytes=bucket_mb << 20)):
        if not rank0:
            continue
        name = f"model-{index + 1:05d}.safetensors"
        save_file({k: v.cpu().contiguous() for k, v in bucket}, str(tmp / name), metadata={"format": "pt"})
        for key, tensor in bucket:
            weight_map[key] = name
            total += tensor.numel() * tensor.element_size()
    if rank0:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        for file in COPIED_FILES:
            if (source / file).is_file():
                shutil.copy2(source / file, tmp / file)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    if dist.is_initialized():
        dist.barrier()
    return out
