"""Is a saved checkpoint whole? Its files are checked against the checkpoint's own records before anything loads.

torch DCP's `megatron/.metadata` lists, for every stored item, the file (relative path) and the byte range
(offset, length) that holds it, so a deleted or truncated `.distcp` file is found from the sizes alone and
named, instead of surfacing as a `CheckpointException` from inside `dist_checkpointing.load`. The error
(`checkpoint_format.damaged`) names the file and the way out.
"""

from __future__ import annotations

from pathlib import Path

from megatron_rl.formats.checkpoint_format import MEGATRON_DIR, damaged, read_checkpoint_json

METADATA = ".metadata"  # torch DCP's index of the .distcp files


def expected_file_sizes(megatron_dir: Path) -> dict[str, int]:
    """Each file torch DCP's `.metadata` refers to -> the bytes it must hold at least (end of its last item)."""
    from torch.distributed.checkpoint import FileSystemReader

    sizes: dict[str, int] = {}
    for info in FileSystemReader(str(megatron_dir)).read_metadata().storage_data.values():
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
    return sizes


def check_checkpoint_files(checkpoint: Path, megatron_subdir: str = MEGATRON_DIR) -> None:
    """Raise DamagedCheckpointError if a file of `checkpoint`'s dist checkpoint is missing or shorter than recorded.

    Cheap (file sizes only): a file of the right size with wrong bytes inside is found only when it is read.
    """
    from megatron_rl.megatron_backend import platform

    megatron_dir = checkpoint / megatron_subdir
    # Written by Megatron's dist_checkpointing next to the torch DCP files (which ones depends on its version).
    for name in (METADATA, "metadata.json", *filter(None, [platform.dist_checkpoint_common_file()])):
        if not (megatron_dir / name).is_file():
            raise damaged(checkpoint, f"{megatron_subdir}/{name} is missing")
    try:
        sizes = expected_file_sizes(megatron_dir)
    except Exception as err:  # noqa: BLE001 - any unpickling failure means the same: the index is unreadable
        raise damaged(checkpoint, f"{megatron_subdir}/{METADATA} is corrupt (cannot be read: {err})") from err
    read_checkpoint_json(checkpoint, f"{megatron_subdir}/metadata.json")
    for name, needed in sorted(sizes.items()):
        file = megatron_dir / name
        if not file.is_file():
            raise damaged(checkpoint, f"{megatron_subdir}/{name} is missing (listed in {megatron_subdir}/{METADATA})")
        size = file.stat().st_size
        if size < needed:
            raise damaged(
                checkpoint,
                f"{megatron_subdir}/{name} is truncated/corrupt ({megatron_subdir}/{METADATA} says it holds at least "
                f"{needed} bytes, the file has {size})",
            )
