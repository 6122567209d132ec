"""Sequence-level GSPO loss on packed sequences, value and gradient in one pass.

Packed layout: the tokens of ``n`` sequences are concatenated into 1-D tensors of length ``cu_seqlens[-1]``;
sequence ``i`` owns ``[cu_seqlens[i], cu_seqlens[i+1])``. ``loss_mask`` marks the tokens that count (the
response); the others get no loss and no gradient. With ``n_i`` valid tokens in sequence ``i``,
``S = #{i : n_i > 0}`` and ``A`` the advantage (per sequence or per token)::

    log s_i = clamp((1/n_i) sum_t (log pi_t - log pi_old_t), -20, 20)        s_i = exp(log s_i)
    l_t     = max(-A_t s_i, -A_t clip(s_i, 1 - eps_low, 1 + eps_high))
    loss    = (1/S) sum_i (1/n_i) sum_{t in i} w_t l_t                        (seq-mean-token-mean)

with optional rollout-correction weights ``w_t`` (1 by default; ``algorithms.rollout_correction``). This is
``algorithms.policy_losses.policy_loss("gspo", ..., agg="seq-mean-token-mean", rollout_weights=w)`` on the
equivalent padded batch (arXiv 2507.18071 eq. 5-7). ``"gspo_token"`` (eq. 13-17) has the same value but routes
the gradient per token: ``d l_t / d log pi_t = s_i * d l_t / d s``, which allows per-token advantages.

Two implementations with the same semantics: ``"torch"`` (segment sums with ``index_add_``; any device) and
``"triton"`` (``triton_gspo``: one program per sequence; compiled on GPU, ``TRITON_INTERPRET=1`` on CPU);
``impl="auto"`` takes Triton where ``triton_support.triton_preferred`` says so (CUDA tensors, triton installed),
``"torch"`` otherwise. Both compute the analytic gradient in the
forward and save only that ``[T]`` vector (and a scale); the backward multiplies it by the upstream gradient.
The trainer (``algo.gspo_kernel``) chooses between these and ``"reference"`` (``policy_loss`` on the padded
batch) with ``select_gspo_kernel``, by the same rule: Triton where preferred, its plain-torch path otherwise.
Derivatives follow torch's conventions exactly so the result matches autograd through the oracle: ``clamp``
passes the gradient on its closed interval, and ``maximum`` splits it evenly on ties (inside the clip range both
branches are ``-A s``).
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, get_args

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from megatron_rl.algorithms.ratios import LOG_RATIO_BOUND
from megatron_rl.kernels.triton_support import check_triton_can_run, triton_preferred

__all__ = [
    "GSPOImpl",
    "GSPOKernel",
    "GSPOVariant",
    "PackedPolicyLoss",
    "packed_gspo_applies",
    "packed_gspo_loss",
    "resolve_gspo_impl",
    "select_gspo_kernel",
]

GSPOVariant = Literal["gspo", "gspo_token"]
GSPOImpl = Literal["auto", "torch", "triton"]
GSPOKernel = Literal["auto", "reference", "torch", "triton"]
"""``algo.gspo_kernel``: a packed implementation, ``"reference"`` (``policy_loss`` on the padded batch) or auto."""


class PackedPolicyLoss(NamedTuple):
    """Scalar loss (differentiable w.r.t. ``log_probs``) and detached metrics."""

    loss: Tensor
    seq_ratio: Tensor  # [n] s_i
    clip_frac_low: Tensor  # fraction of valid tokens with A < 0 and s_i < 1 - eps_low
    clip_frac_high: Tensor  # fraction of valid tokens with A > 0 and s_i > 1 + eps_high


def _forward_and_grad(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    cu_seqlens: Tensor,
    loss_mask: Tensor | None,
    rollout_weights: Tensor | None,
    clip_low: float,
    clip_high: float,
    variant: GSPOVariant,
) -> tuple[PackedPolicyLoss, Tensor]:
    dtype = log_probs.dtype if log_probs.dtype in (torch.float32, torch.float64) else torch.float32
    device = log_probs.device
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    n_seq = lengths.numel()
    seg = torch.repeat_interleave(torch.arange(n_seq, device=device), lengths, output_size=log_probs.numel())
    mask = torch.ones_like(log_probs, dtype=torch.bool) if loss_mask is None else loss_mask.bool()
    zero = torch.zeros((), dtype=dtype, device=device)

    log_ratio = torch.where(mask, log_probs.to(dtype) - old_log_probs.to(dtype), zero)
    adv = advantages.to(dtype)
    adv = torch.where(mask, adv[seg] if adv.numel() == n_seq and adv.numel() != log_probs.numel() else adv, zero)

    n_valid = torch.zeros(n_seq, dtype=dtype, device=device).index_add_(0, seg, mask.to(dtype))
    count = n_valid.clamp(min=1)
    seq_log_ratio = torch.zeros(n_seq, dtype=dtype, device=device).index_add_(0, seg, log_ratio) / count
    seq_ratio = seq_log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
    clamp_passes = (seq_log_ratio >= -LOG_RATIO_BOUND) & (seq_log_ratio <= LOG_RATIO_BOUND)

    ratio = seq_ratio[seg]
    low, high = 1 - clip_low, 1 + clip_high
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(low, high)
    token_loss = torch.maximum(unclipped, clipped)
    num_seqs = (n_valid > 0).sum().clamp(min=1).to(dtype)
    weight = torch.where(mask, 1.0 / (count[seg] * num_seqs), zero)
    if rollout_weights is not None:
        weight = weight * rollout_weights.to(dtype)
    loss = (weight * token_loss).sum()

    # d l_t / d s: the winning branch's slope; on a tie, the mean of both (torch.maximum's convention).
    in_range = ((ratio >= low) & (ratio <= high)).to(dtype)
    slope = torch.where(unclipped > clipped, 1.0, torch.where(unclipped < clipped, in_range, 0.5 * (1 + in_range)))
    grad_ratio = weight * (-adv) * slope  # d loss / d s_t
    if variant == "gspo":
        grad_seq = torch.zeros(n_seq, dtype=dtype, device=device).index_add_(0, seg, grad_ratio)
        grad_seq = grad_seq * seq_ratio * clamp_passes / count
        grad = torch.where(mask, grad_seq[seg], zero)
    else:
        grad = grad_ratio * ratio * clamp_passes[seg]

    valid_tokens = mask.sum().clamp(min=1).to(dtype)
    metrics = PackedPolicyLoss(
        loss=loss,
        seq_ratio=seq_ratio,
        clip_frac_low=((adv < 0) & (ratio < low) & mask).sum().to(dtype) / valid_tokens,
        clip_frac_high=((adv > 0) & (ratio > high) & mask).sum().to(dtype) / valid_tokens,
    )
    return metrics, grad


def resolve_gspo_impl(impl: GSPOImpl, log_probs: Tensor) -> Literal["torch", "triton"]:
    """The concrete implementation ``impl`` stands for with these log-probs."""
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl must be one of ('auto', 'torch', 'triton'), got {impl!r}")
    if impl == "auto":
        return "triton" if triton_preferred(log_probs) else "torch"
    return impl


def packed_gspo_applies(loss: str, agg: str) -> bool:
    """Whether ``packed_gspo_loss`` computes this policy loss and aggregation (GSPO, seq-mean-token-mean)."""
    return loss in ("gspo", "gspo_token") and agg == "seq-mean-token-mean"


def select_gspo_kernel(
    kernel: GSPOKernel, log_probs: Tensor, *, loss: str, agg: str
) -> Literal["reference", "torch", "triton"]:
    """``"reference"``, ``"torch"`` or ``"triton"``: what the trainer's ``kernel`` stands for with these log-probs.

    An explicit kernel is returned as given (config validation refuses a packed one where it does not apply).
    ``"auto"`` takes the Triton kernel where it applies and ``triton_preferred`` holds; otherwise the trainer's
    plain-torch path, ``"reference"``, which is the oracle the packed kernels are tested against.
    """
    if kernel not in get_args(GSPOKernel):
        raise ValueError(f"kernel must be one of {get_args(GSPOKernel)}, got {kernel!r}")
    if kernel != "auto":
        return kernel
    return "triton" if packed_gspo_applies(loss, agg) and triton_preferred(log_probs) else "reference"


# old_log_probs, advantages, cu_seqlens, loss_mask, rollout_weights, clip_low, clip_high
_Constants = tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None, float, float]


class _PackedGSPO(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,  # torch's FunctionCtx stub declares neither saved_tensors nor the attributes stored on it
        log_probs: Tensor,
        impl: str,
        variant: GSPOVariant,
        *args: *_Constants,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if impl == "triton":
            from megatron_rl.kernels.triton_gspo import triton_gspo_forward_and_grad

            *stats, grad, scale = triton_gspo_forward_and_grad(log_probs, *args, token_grad=variant == "gspo_token")
            out = PackedPolicyLoss(*stats)
        else:
            out, grad = _forward_and_grad(log_probs, *args, variant)
            scale = torch.ones((), dtype=grad.dtype, device=grad.device)
        ctx.save_for_backward(grad, scale)
        ctx.log_probs_dtype = log_probs.dtype
        ctx.mark_non_differentiable(out.seq_ratio, out.clip_frac_low, out.clip_frac_high)
        return out.loss, out.seq_ratio, out.clip_frac_low, out.clip_frac_high

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: Tensor, *unused: Tensor) -> tuple:
        grad, scale = ctx.saved_tensors
        return (grad * (grad_loss * scale)).to(ctx.log_probs_dtype), *([None] * 10)


def packed_gspo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    cu_seqlens: Tensor,
    loss_mask: Tensor | None = None,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    variant: GSPOVariant = "gspo",
    rollout_weights: Tensor | None = None,
    impl: GSPOImpl = "auto",
) -> PackedPolicyLoss:
    """GSPO / GSPO-token loss (to minimise) of packed sequences; see the module docstring.

    Args:
        log_probs: ``[T]`` current-policy log-probs of the packed tokens (the only differentiable input).
        old_log_probs: ``[T]`` behaviour-policy log-probs (treated as constants).
        advantages: ``[n]`` per sequence or ``[T]`` per token (constants).
        cu_seqlens: ``[n + 1]`` integer offsets, ``cu_seqlens[0] == 0`` and ``cu_seqlens[-1] == T``.
        loss_mask: ``[T]`` bool/0-1 mask of the tokens that count; ``None`` means all.
        clip_low, clip_high: ``eps_low``, ``eps_high`` of the clip range ``[1 - eps_low, 1 + eps_high]``.
        variant: ``"gspo"`` or ``"gspo_token"``.
        rollout_weights: ``[T]`` per-token weights of the clipped loss (TIS/MIS/IcePop; constants), or ``None``.
        impl: ``"torch"``, ``"triton"`` or ``"auto"`` (Triton for CUDA tensors when installed).
    """
    chosen = resolve_gspo_impl(impl, log_probs)
    if variant not in ("gspo", "gspo_token"):
        raise ValueError(f"variant must be 'gspo' or 'gspo_token', got {variant!r}")
    if log_probs.dim() != 1 or old_log_probs.shape != log_probs.shape:
        raise ValueError(f"log_probs and old_log_probs must be the same 1-D shape, got {tuple(log_probs.shape)} "
                         f"and {tuple(old_log_probs.shape)}")  # fmt: skip
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or int(cu_seqlens[0]) != 0:
        raise ValueError("cu_seqlens must be a 1-D tensor of offsets starting at 0")
    if int(cu_seqlens[-1]) != log_probs.numel():
        raise ValueError(f"cu_seqlens[-1]={int(cu_seqlens[-1])} must equal the number of tokens {log_probs.numel()}")
    if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError("cu_seqlens must be non-decreasing")
    n_seq = cu_seqlens.numel() - 1
    if advantages.shape not in ((n_seq,), log_probs.shape):
        raise ValueError(f"advantages must be [{n_seq}] or [{log_probs.numel()}], got {tuple(advantages.shape)}")
    if loss_mask is not None and loss_mask.shape != log_probs.shape:
        raise ValueError(f"loss_mask must be [{log_probs.numel()}], got {tuple(loss_mask.shape)}")
    if rollout_weights is not None and rollout_weights.shape != log_probs.shape:
        raise ValueError(f"rollout_weights must be [{log_probs.numel()}], got {tuple(rollout_weights.shape)}")
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0, got {clip_low}, {clip_high}")
    if chosen == "triton":
        check_triton_can_run(log_probs, "packed_gspo_loss")
    outputs = _PackedGSPO.apply(
        log_probs, chosen, variant, old_log_probs.detach(), advantages.detach(), cu_seqlens, loss_mask,
        None if rollout_weights is None else rollout_weights.detach(), clip_low, clip_high,
    )  # fmt: skip
    return PackedPolicyLoss(*outputs)
