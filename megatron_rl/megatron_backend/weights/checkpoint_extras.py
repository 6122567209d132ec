"""The files an exported Hugging Face model needs besides its weights: the tokenizer (all from one source) and
`generation_config.json`, found for a checkpoint in `--hf-extras`, its `hf/` folder or the run that wrote it."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from megatron_rl.formats.checkpoint_format import HF_EXTRAS_DIR
from megatron_rl.formats.safetensors_files import HF_EXTRA_FILES, copy_files


def _extras_sources(checkpoint: Path, explicit: str | Path | None) -> list[tuple[Path, str]]:
    """Where a checkpoint's tokenizer and generation files may be, first choice first, each with a description.

    `--hf-extras`, the checkpoint's `hf/` (a converted checkpoint), then for a `megatron-rl train` checkpoint
    (`<run>/checkpoints/step_*`) the run's `model.tokenizer_path` and `model.hf_path` from `<run>/config.yaml`.
    """
    if explicit is not None:
        if not Path(explicit).is_dir():
            raise FileNotFoundError(f"--hf-extras {explicit} is not a directory (an HF model directory is expected)")
        return [(Path(explicit), f"--hf-extras {explicit}")]
    sources = [(checkpoint / HF_EXTRAS_DIR, f"{checkpoint / HF_EXTRAS_DIR}")]
    if checkpoint.parent.name != "checkpoints":
        return sources
    run = checkpoint.parent.parent
    config = run / "config.yaml"
    try:
        saved = yaml.safe_load(config.read_text()) or {}
        model, output_dir = saved.get("model") or {}, (saved.get("trainer") or {}).get("output_dir")
    except (OSError, yaml.YAMLError, AttributeError):
        return [*sources, (config, f"{config} (missing or unreadable)")]
    start_dir = _run_start_dir(run, output_dir)
    seen: set[Path] = set()
    for key in ("tokenizer_path", "hf_path"):
        value = model.get(key)
        if not isinstance(value, str) or start_dir / value in seen:
            continue  # tokenizer_path defaults to hf_path: look there once
        path = start_dir / value  # an absolute value stays as it is
        seen.add(path)
        sources.append((path, f"model.{key}={value} of {config}" + ("" if path.is_dir() else " (not found)")))
    return sources


def _run_start_dir(run: Path, output_dir: object) -> Path:
    """The directory `megatron-rl train` ran in, where the relative paths of its config.yaml start.

    Known when the config's `trainer.output_dir` is relative and `run` ends with it (`runs/x` -> the folder
    holding `runs/`); otherwise the current directory.
    """
    parts = Path(output_dir).parts if isinstance(output_dir, str) and not Path(output_dir).is_absolute() else ()
    resolved = run.resolve().parts
    if parts and ".." not in parts and resolved[-len(parts) :] == parts:
        return Path(*resolved[: -len(parts)])
    return Path.cwd()


def copy_checkpoint_extras(checkpoint: Path, dest: Path, out: Path, explicit: str | Path | None) -> tuple[str, ...]:
    """Copy the tokenizer files (all from one source) and generation_config.json; return notes on what is missing."""
    sources = _extras_sources(checkpoint, explicit)
    searched = "; ".join(where for _, where in sources)

    def first_holding(names: list[str]) -> Path | None:
        return next((d for d, _ in sources if d.is_dir() and any((d / n).is_file() for n in names)), None)

    tokenizer_files = [name for name in HF_EXTRA_FILES if name != "generation_config.json"]
    notes = []
    tokenizer_dir = first_holding(tokenizer_files)  # all from one place: never mix two tokenizers' files
    if tokenizer_dir is None:
        notes.append(
            f"{out} has no tokenizer: none of {', '.join(tokenizer_files)} found in {searched}; add them with "
            "--hf-extras /path/to/hf_model (the model the checkpoint was trained from)"
        )
    else:
        copy_files(tokenizer_dir, dest, tokenizer_files)
    generation_dir = first_holding(["generation_config.json"])
    if generation_dir is None:
        notes.append(
            f"{out}/generation_config.json holds only config.json's bos/eos/pad token ids: none found in "
            f"{searched}; add the model's own with --hf-extras /path/to/hf_model"
        )
    else:
        shutil.copy2(generation_dir / "generation_config.json", dest / "generation_config.json")
    return tuple(notes)
