"""Megatron-Core 0.16.x vs 0.19.x: the version guard, and each difference the package depends on as one named
question. Call sites ask these instead of testing versions, signatures or attributes themselves.

(The CPU bridge's own 0.16-only patch, `moe_utils.te_general_gemm`, and 0.19's triton stub stay with the bridge.)
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import inspect
import warnings
from collections.abc import Callable
from typing import Any

from megatron_rl import accelerator as _accelerator

SUPPORTED_MCORE: tuple[str, ...] = ("0.16.", "0.19.")
"""Megatron-Core release lines this module was checked against (version prefixes)."""


def installed_megatron_version() -> str:
    """Return the installed megatron-core version without importing megatron."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError as exc:
        raise RuntimeError(
            "megatron-core is not installed; supported versions: " + ", ".join(f"{p}x" for p in SUPPORTED_MCORE)
        ) from exc


def check_megatron_version(version: str | None = None, device_type: str | None = None) -> str:
    """Return the megatron-core version; refuse an untested release where the CPU bridges apply.

    The CPU bridges patch private Megatron functions whose names move between releases, so on
    ``device_type="cpu"`` an untested release raises instead of being patched blindly. On
    ``"cuda"`` nothing is patched: an untested release gets a warning and the run goes on.

    Args:
        version: the version to check (default: the installed one).
        device_type: "cpu" or "cuda" (default: this process's platform, see `device()`).
    """
    version = installed_megatron_version() if version is None else version
    if version.startswith(SUPPORTED_MCORE):
        return version
    if device_type is None:
        device_type = "cpu" if _accelerator._on_cpu() else "cuda"
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    tested = ", ".join(p + "x" for p in SUPPORTED_MCORE)
    if device_type == "cpu":
        raise RuntimeError(
            f"megatron-core {version} is installed, but the CPU bridges of megatron_rl support only {tested}. "
            "Add the new release to megatron_rl/megatron_backend/platform/mcore_compat.py only after re-checking "
            "its CUDA assumptions (see cuda_hits())."
        )
    warnings.warn(
        f"megatron-core {version} is untested with megatron_rl (tested: {tested}); nothing is patched on CUDA, "
        "so the run goes on",
        UserWarning,
        stacklevel=2,
    )
    return version


def dist_checkpoint_common_file() -> str | None:
    """The file a Megatron dist checkpoint keeps its non-tensor state in, next to torch DCP's files: "common.pt"
    in 0.16.x; None in 0.19.x, where torch DCP holds that state itself (save_common/load_common are deprecated)."""
    return None if check_megatron_version().startswith("0.19.") else "common.pt"


def checkpoint_writer_results_queue() -> Any:
    """The results queue of Megatron's checkpoint writer, created on first use: a spawned multiprocessing Manager
    process that lives as long as this process (`_get_write_results_queue` in 0.16.x, `get_write_results_queue`
    in 0.19.x; megatron/core/dist_checkpointing/strategies/filesystem_async.py)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    get_queue = getattr(filesystem_async, "get_write_results_queue", None) or filesystem_async._get_write_results_queue
    return get_queue()


def save_takes_async_strategy(save: Callable[..., Any]) -> bool:
    """Whether `dist_checkpointing.save` takes `async_strategy` (0.19.x, defaulting to NVIDIA Resiliency
    Extension's writer, "nvrx"); 0.16.x has only Megatron's own writer and no such argument."""
    return "async_strategy" in inspect.signature(save).parameters


def mla_resolves_norms_by_backend() -> bool:
    """Whether `MLASelfAttention` chooses its Q/KV norm modules through the backend (`_resolve_qk_norm_config`,
    0.19.x); 0.16.x takes them from the layer spec's submodules as given."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    return hasattr(MLASelfAttention, "_resolve_qk_norm_config")


def spec_submodules(spec: Any) -> Any:
    """A module spec's submodules: a `ModuleSpec`'s field, or (0.19.x's MoE specs) the `submodules` keyword of a
    `functools.partial`."""
    return spec.keywords["submodules"] if isinstance(spec, functools.partial) else spec.submodules


def spec_with_submodules(spec: Any, **changes: Any) -> Any:
    """A copy of `spec` (either form of `spec_submodules`) with fields of its submodules replaced (specs are shared
    between layers: never edited)."""
    submodules = dataclasses.replace(spec_submodules(spec), **changes)
    if isinstance(spec, functools.partial):
        return functools.partial(spec.func, *spec.args, **{**spec.keywords, "submodules": submodules})
    return dataclasses.replace(spec, submodules=submodules)
