"""Fused loss kernels: vocab-parallel token log-probs + entropy, and packed sequence-level GSPO (``gspo``).

``token_logprobs_and_entropy`` dispatches between three implementations with identical semantics (those of
``kernels.reference_logprob.token_logprobs_and_entropy``):

* ``"torch"``: the reference (one MAX + one SUM all-reduce, ``[tokens, V_local]`` fp32 buffers);
* ``"chunked"``: torch, a chunk of rows at a time, one all-gather (``chunked_logprob``); the CPU default;
* ``"triton"``: fused Triton kernels, one all-gather (``triton_logprob``); the CUDA default.

``impl="auto"`` picks ``"triton"`` where ``triton_support.triton_preferred`` says so (CUDA logits, triton
installed), ``"chunked"`` otherwise; that rule is the one place that looks at the device, for every kernel here. The
Triton module is imported lazily: on CPU it needs ``TRITON_INTERPRET=1`` in the environment before that import.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from megatron_rl.kernels.chunked_logprob import chunked_logprobs_and_entropy
from megatron_rl.kernels.gspo import (
    GSPOImpl,
    GSPOKernel,
    GSPOVariant,
    PackedPolicyLoss,
    packed_gspo_applies,
    packed_gspo_loss,
    resolve_gspo_impl,
    select_gspo_kernel,
)
from megatron_rl.kernels.reference_logprob import check_logprob_args
from megatron_rl.kernels.triton_support import check_triton_can_run, triton_available, triton_preferred

__all__ = [
    "GSPOImpl",
    "GSPOKernel",
    "GSPOVariant",
    "Impl",
    "PackedPolicyLoss",
    "packed_gspo_applies",
    "packed_gspo_loss",
    "resolve_gspo_impl",
    "resolve_impl",
    "select_gspo_kernel",
    "next_token_logprobs_and_entropy",
    "token_logprobs_and_entropy",
    "triton_available",
    "triton_preferred",
]

Impl = Literal["auto", "torch", "chunked", "triton"]
_IMPLS = ("auto", "torch", "chunked", "triton")


def resolve_impl(impl: Impl, logits: Tensor) -> str:
    """The concrete implementation ``impl`` stands for with these logits."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if impl == "auto":
        return "triton" if triton_preferred(logits) else "chunked"
    return impl


def token_logprobs_and_entropy(
    logits: Tensor,
    targets: Tensor,
    *,
    tp_group: ProcessGroup | None = None,
    vocab_start_index: int | None = None,
    valid_vocab_size: int | None = None,
    temperature: float = 1.0,
    with_entropy: bool = True,
    impl: Impl = "auto",
    chunk_rows: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of ``targets`` and entropy of ``softmax(logits / temperature)``, vocab split over ``tp_group``.

    Arguments and results as in ``kernels.reference_logprob.token_logprobs_and_entropy`` (this rank's
    contiguous shard ``[..., V_local]``; global ``targets``; fp32 outputs identical on every rank; gradient in the
    logits' dtype), plus ``impl`` (see the module docstring) and ``chunk_rows`` (rows per chunk of the
    ``"chunked"`` implementation; default: 2**24 elements per fp32 work buffer). ``-inf`` logits are allowed
    (probability 0, zero gradient) in ``"chunked"`` and ``"triton"``.
    """
    chosen = resolve_impl(impl, logits)
    if chosen == "torch":
        from megatron_rl.kernels.reference_logprob import token_logprobs_and_entropy as reference

        return reference(
            logits, targets, tp_group=tp_group, vocab_start_index=vocab_start_index,
            valid_vocab_size=valid_vocab_size, temperature=temperature, with_entropy=with_entropy,
        )  # fmt: skip
    tp_group, vocab_start_index = check_logprob_args(logits, targets, tp_group, vocab_start_index, temperature)
    kwargs: dict[str, Any] = {"tp_group": tp_group, "vocab_start_index": vocab_start_index,
                              "valid_vocab_size": valid_vocab_size, "temperature": float(temperature)}  # fmt: skip
    if chosen == "triton":
        check_triton_can_run(logits, "token_logprobs_and_entropy")
        from megatron_rl.kernels.triton_logprob import triton_logprobs_and_entropy

        logprobs, entropy = triton_logprobs_and_entropy(logits, targets, **kwargs)
    else:
        logprobs, entropy = chunked_logprobs_and_entropy(logits, targets, chunk_rows=chunk_rows, **kwargs)
    return logprobs, entropy if with_entropy else None


def next_token_logprobs_and_entropy(logits: Tensor, input_ids: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """``log p(input_ids[:, t] | input_ids[:, :t])`` and the entropy of the distribution it is drawn from,
    ``[b, s]`` aligned with ``input_ids`` (position 0, which has no context, is 0), from a causal model's
    logits ``[b, s, V_local]``. ``kwargs`` as in ``token_logprobs_and_entropy``."""
    logp, ent = token_logprobs_and_entropy(logits[:, :-1], input_ids.to(logits.device)[:, 1:], **kwargs)
    logp = torch.nn.functional.pad(logp, (1, 0))
    return logp, None if ent is None else torch.nn.functional.pad(ent, (1, 0))
