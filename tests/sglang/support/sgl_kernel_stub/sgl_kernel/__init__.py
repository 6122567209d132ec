"""CPU TEST SHIM standing in for the CUDA-only `sgl_kernel` wheel (see tests/sglang/support/README.md)."""

from __future__ import annotations

__version__ = "0.0.0+cpu-test-shim"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """req_to_token[req, start:end] = the next (end - start) entries of out_cache_loc, request by request."""
    offset = 0
    for req, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        n = end - start
        req_to_token[req, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def _stub(name: str):
    def fn(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not available in the CPU test shim")

    fn.__name__ = name
    return fn


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _stub(name)


copy_all_layer_kv_cache_cpu = _stub("copy_all_layer_kv_cache_cpu")
