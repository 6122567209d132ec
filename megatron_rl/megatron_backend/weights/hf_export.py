"""Write the actor's weights as a Hugging Face checkpoint directory (safetensors shards + index).

Streams `MegatronActor.export_hf` buckets: each bucket becomes one shard, so host memory stays at one
bucket. Rank 0 writes (`write_safetensors_dir`: a staging directory renamed when complete); config,
generation config and tokenizer files are copied from the source HF directory.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from megatron_rl.formats.safetensors_files import HF_EXTRA_FILES, copy_files, write_safetensors_dir
from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor

COPIED_FILES = ("config.json", *HF_EXTRA_FILES)


def save_hf_checkpoint(
    actor: MegatronActor, out_dir: str | Path, source_dir: str | Path, *, bucket_mb: int = 2048
) -> Path:
    """Collective. Returns the written directory."""
    out, source = Path(out_dir), Path(source_dir)
    buckets = actor.export_hf(bucket_bytes=bucket_mb << 20)
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_safetensors_dir(out, buckets, extra_files=lambda staging: copy_files(source, staging, COPIED_FILES))
    else:
        for _ in buckets:  # the export is collective: every rank walks it to the end
            pass
    if dist.is_initialized():
        dist.barrier()
    return out
