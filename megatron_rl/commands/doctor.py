"""`megatron-rl doctor`: what is installed and usable here (versions, GPUs, optional extras, wandb mode)."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform as py_platform
import warnings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def run(args: argparse.Namespace) -> int:
    import torch

    from megatron_rl import __version__
    from megatron_rl.megatron_backend import platform
    from megatron_rl.optional_deps import is_available

    rows = [
        ("megatron-rl", __version__),
        ("python", py_platform.python_version()),
        ("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})"),
        ("GPUs", ", ".join(platform.accelerator_names()) or "none (CPU)"),
        ("megatron-core", _version("megatron-core")),
    ]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            platform.check_megatron_version()
        supported = ", ".join(v + "x" for v in platform.SUPPORTED_MCORE)
        untested = f"untested release (runs on CUDA, nothing patched; tested: {supported})"
        rows.append(("megatron-core support", untested if caught else f"ok ({supported})"))
    except RuntimeError as err:
        rows.append(("megatron-core support", f"PROBLEM: {err}"))
    for module, dist in (
        ("transformer_engine.pytorch", "transformer-engine"),
        ("triton", "triton"),
        ("apex", "apex"),
        ("sglang", "sglang"),
        ("sglang_router", "sglang-router"),
        ("transformers", "transformers"),
        ("wandb", "wandb"),
        ("tensorboard", "tensorboard"),
    ):
        usable = is_available(module)
        rows.append((dist, f"{_version(dist)}{'' if usable else ' (not importable)'}"))
    rows.append(
        ("layer spec", "Transformer Engine" if platform.transformer_engine_available() else "local (Megatron-Core)")
    )
    rows.append(("wandb mode (auto)", "online" if os.environ.get("WANDB_API_KEY") else "offline (no WANDB_API_KEY)"))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0
