"""The ledger of the CPU bridges: which Megatron call sites reached which CUDA assumption (`cuda_hits()`).

A new entry after a Megatron upgrade means a new CUDA assumption on the path a test exercised."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import types

import torch

_LEDGER: dict[tuple[str, str], int] = {}
_LEDGER_LOCK = threading.Lock()
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_megatron_dir_cache: str | None = None
_SITE_CACHE: dict[tuple[types.CodeType, int], str] = {}


def _megatron_dir() -> str:
    """The `megatron/` package directory, with a trailing separator (found without importing it)."""
    global _megatron_dir_cache
    if _megatron_dir_cache is None:
        spec = importlib.util.find_spec("megatron.core")
        locations = list(spec.submodule_search_locations or []) if spec else []
        core = os.path.abspath(locations[0]) if locations else ""
        _megatron_dir_cache = os.path.dirname(core) + os.sep if core else "\0"
    return _megatron_dir_cache


def _call_site() -> str:
    """The innermost megatron frame on the stack, as 'megatron/...py:LINE func'.

    Falls back to the innermost frame outside torch and this package, marked '(outside)'.
    The answer for a megatron caller is cached by its code location, so a bridge hit on a
    forward path costs a dictionary lookup, not a stack walk.
    """
    megatron_dir = _megatron_dir()
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
    if frame is None:
        return "(unknown)"
    key = (frame.f_code, frame.f_lineno)
    site = _SITE_CACHE.get(key)
    if site is not None:
        return site
    strip = len(os.path.dirname(megatron_dir.rstrip(os.sep))) + 1
    caller_in_megatron = frame.f_code.co_filename.startswith(megatron_dir)
    outside = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(megatron_dir):
            site = f"{filename[strip:]}:{frame.f_lineno} {frame.f_code.co_name}"
            if caller_in_megatron:
                _SITE_CACHE[key] = site
            return site
        if outside is None and not filename.startswith(_PACKAGE_DIR) and not filename.startswith(_TORCH_DIR):
            outside = f"(outside) {filename}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return outside or "(unknown)"


def record(api: str) -> None:
    key = (api, _call_site())
    with _LEDGER_LOCK:
        _LEDGER[key] = _LEDGER.get(key, 0) + 1


def cuda_hits() -> dict[str, dict[str, int]]:
    """CUDA assumptions that fired since the bridges were applied.

    Returns ``{api: {call_site: hit_count}}`` in first-hit order, where ``call_site`` is
    the innermost megatron frame ('megatron/core/...py:LINE function').
    """
    out: dict[str, dict[str, int]] = {}
    with _LEDGER_LOCK:
        for (api, site), count in _LEDGER.items():
            out.setdefault(api, {})[site] = count
    return out


def format_cuda_hits() -> str:
    """The ledger as lines 'CUDA-HIT <api> x<count> <call site>'."""
    with _LEDGER_LOCK:
        items = list(_LEDGER.items())
    return "\n".join(f"CUDA-HIT {api} x{count} {site}" for (api, site), count in items)
