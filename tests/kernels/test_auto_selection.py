"""Every ``impl="auto"`` of the kernels, and the trainer's ``algo.gspo_kernel=auto``, follow one rule
(``triton_preferred``): Triton for CUDA tensors when triton is installed, the caller's plain-torch path otherwise.
The CUDA case runs where a GPU is present (``scripts/gpu_check.sh``); on CPU the fallbacks are checked."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.kernels import (
    packed_gspo_applies,
    resolve_gspo_impl,
    resolve_impl,
    select_gspo_kernel,
    triton_available,
    triton_preferred,
)

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", DEVICES)
def test_every_auto_follows_triton_preferred(device: str) -> None:
    t = torch.zeros(2, 3, device=device)
    triton = triton_preferred(t)
    assert triton == (device == "cuda" and triton_available())
    assert resolve_impl("auto", t) == ("triton" if triton else "chunked")
    assert resolve_gspo_impl("auto", t) == ("triton" if triton else "torch")
    for loss in ("gspo", "gspo_token"):
        assert select_gspo_kernel("auto", t, loss=loss, agg="seq-mean-token-mean") == (
            "triton" if triton else "reference"
        )
    # Where the packed kernel does not compute the loss, auto is the reference whatever the device.
    assert select_gspo_kernel("auto", t, loss="gspo", agg="token-mean") == "reference"
    assert select_gspo_kernel("auto", t, loss="ppo", agg="seq-mean-token-mean") == "reference"


def test_explicit_kernels_pass_through_and_bad_names_fail() -> None:
    cpu = torch.zeros(2, 3)
    for kernel in ("reference", "torch", "triton"):
        assert select_gspo_kernel(kernel, cpu, loss="gspo", agg="seq-mean-token-mean") == kernel
    with pytest.raises(ValueError, match="kernel must be one of"):
        select_gspo_kernel("cuda", cpu, loss="gspo", agg="seq-mean-token-mean")  # type: ignore[arg-type]


def test_packed_gspo_applies_to_gspo_seq_mean_token_mean_only() -> None:
    assert packed_gspo_applies("gspo", "seq-mean-token-mean")
    assert packed_gspo_applies("gspo_token", "seq-mean-token-mean")
    assert not packed_gspo_applies("gspo", "token-mean")
    assert not packed_gspo_applies("gspo_token", "seq-mean-token-sum")
    assert not packed_gspo_applies("grpo", "seq-mean-token-mean")
