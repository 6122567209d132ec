"""Fixtures for Megatron tests: a one-process Megatron world (gloo on CPU, TP=PP=EP=1)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from megatron_rl.parallel_layout import ParallelLayout, ResolvedLayout


@pytest.fixture(scope="module")
def megatron_world() -> Iterator[ResolvedLayout]:
    """torch.distributed (world of one) plus Megatron's process groups, torn down after the module.

    Also disables torch.compile (Megatron's `jit_fuser`): seconds of compilation per shape
    on CPU for no gain at these sizes.
    """
    from megatron_rl.megatron_backend import platform

    platform.prepare_megatron_import()
    from megatron_rl.megatron_backend.distributed import init_distributed, shutdown

    dynamo_disabled = torch._dynamo.config.disable
    torch._dynamo.config.disable = True
    try:
        yield init_distributed(ParallelLayout(), seed=1234)
    finally:
        shutdown()
        torch._dynamo.config.disable = dynamo_disabled
