"""The local layer spec's core attention through torch's `scaled_dot_product_attention` (SDPA).

Megatron-Core's local `DotProductAttention` (transformer/dot_product_attention.py, the same in 0.16.x and 0.19.x)
computes attention in Python: `baddbmm` of the scaled scores, a mask filled with -10000 and a softmax
(fusions/fused_softmax.py `FusedScaleMaskSoftmax`), dropout, `bmm` with the values. `sdpa_variant` subclasses it
(or any subclass: MLA's, GPT-OSS's) with a forward that computes the same through SDPA, one fused kernel on the
CPU (flash attention for CPU) and flash / memory-efficient kernels on the GPU. What it reproduces:

- the scale: the parent's `softmax_scale` (1/sqrt(head dim), or the one passed in: MLA's with its YaRN mscale)
  times the softmax's `scale` (`apply_query_key_layer_scaling` divides the first by the layer number and
  multiplies the scores back by it);
- the mask: with no `attention_mask`, causal when the module is causal (`attn_mask_type`, the softmax's; the
  forward's argument is ignored, as the parent ignores it) and more than one query; an `attention_mask` (boolean,
  True = masked) replaces the causal mask, as in the parent; a row the mask covers entirely gets the parent's
  result for it, the mean of the values (its scores all become -10000, so its softmax is uniform), where SDPA
  would give zeros. Unmasked keys of other rows get exp(-10000 - max) = 0 in the parent, exactly SDPA's -inf;
- grouped-query attention: `enable_gqa` repeats each key/value head over its query heads (head i reads group
  i // (heads / groups)), which is the parent's `repeat_interleave`;
- a value head width other than the query's (MLA; 0.19.x's THD value padding): the output is heads x value width;
- attention dropout while training, under the model-parallel RNG like the parent (the mask drawn differs: the
  kernel draws its own);
- attention sinks (`softmax_type` "learnable" or "off-by-one", GPT-OSS; `SoftmaxOne`: one more logit per head
  whose probability is dropped) as one more key per head, with a zero value, scored by the sink through the
  additive mask; a row masked entirely then gives 0, as in the parent;
- sliding windows (`window_size` on the layers `window_attn_skip_freq` marks): the parent's window mask, which
  replaces any other.

What SDPA cannot express here goes to the parent's forward unchanged: an attention bias, packed sequences (the
parent refuses them; `packed_attention.packed_variant` wraps this class and calls it per length bucket), a
non-boolean mask, and cross attention with a causal mask (the parent asserts). In half precision the parent rounds
the scores to bf16/fp16 before its fp32 softmax; SDPA keeps them in fp32 inside the kernel (more accurate, not
bitwise equal). With sinks the mask needs a gradient while training (learnable sinks), which the fused CPU kernel
does not take: SDPA would pick its reference (math) kernel in training and the fused one in scoring, and the two
round differently (the first update's ppo_kl would not be exactly 0). So with sinks it is always the math kernel:
one call from Python, without the parent's Python steps.
Selected by `model.options.local_attention` (model_builder); Transformer Engine's attention is left as it is.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


@functools.cache
def sdpa_variant(cls: type) -> type:
    """A subclass of the local core attention `cls` (a Megatron `DotProductAttention`) computing through SDPA."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.enums import AttnMaskType

    class SDPACoreAttention(cls):
        def forward(
            self,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: torch.Tensor | None,
            attn_mask_type: Any = None,
            attention_bias: Any = None,
            packed_seq_params: Any = None,
        ) -> torch.Tensor:
            softmax, sinks, window = self.scale_mask_softmax, self.softmax_offset, self.scale_mask_softmax.window_size
            sq, b, sk = query.shape[0], query.shape[1], key.shape[0]
            causal = attention_mask is None and softmax.attn_mask_type == AttnMaskType.causal and sq > 1
            if (
                attention_bias is not None
                or packed_seq_params is not None
                or (attention_mask is not None and attention_mask.dtype != torch.bool)
                or (causal and window is None and sq != sk)
            ):
                return super().forward(
                    query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
                )
            # [s, b, heads, dim] -> [b, heads, s, dim] (strided views: the CPU kernel reads them in place)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            allowed, covered = None, None
            if window is not None:  # the parent's sliding-window mask replaces any other
                offset = torch.arange(sk, device=q.device) - torch.arange(sq, device=q.device).unsqueeze(1) - (sk - sq)
                allowed, causal = (offset >= -window[0]) & (offset <= window[1]), False
            elif attention_mask is not None:
                allowed = ~attention_mask
                if sinks is None:  # rows masked entirely: the parent softmaxes their -10000s uniformly
                    covered = attention_mask.all(dim=-1, keepdim=True)
                    allowed = allowed | covered
            if sinks is not None:
                # SoftmaxOne: one more logit per head, the sink, whose probability is dropped: a key scored by the
                # sink through the additive mask, with a zero value. A row masked entirely gives 0, as in the parent.
                if causal:
                    allowed, causal = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(), False
                mask = torch.zeros(sq, sk, device=q.device) if allowed is None else allowed.float().log()  # 0/-inf
                mask = mask.to(q.dtype).view((1,) * (4 - mask.dim()) + tuple(mask.shape))  # [b or 1, heads or 1, ...]
                rows, heads = mask.shape[0], q.shape[1]
                sink = sinks.to(q.dtype).view(1, heads, 1, 1).expand(rows, heads, sq, 1)
                allowed = torch.cat([mask.expand(rows, heads, sq, sk), sink], dim=-1)  # [b or 1, heads, sq, sk + 1]
                k, v = (torch.cat([t, t.new_zeros(b, t.shape[1], 1, t.shape[3])], dim=2) for t in (k, v))
            dropout = self.attention_dropout.p if self.training else 0.0
            fork = dropout > 0 and not self.config.sequence_parallel
            with (
                tensor_parallel.get_cuda_rng_tracker().fork() if fork else contextlib.nullcontext(),
                sdpa_kernel(SDPBackend.MATH) if sinks is not None else contextlib.nullcontext(),
            ):
                context = F.scaled_dot_product_attention(
                    q,
                    k,
                    v,
                    attn_mask=allowed,
                    dropout_p=dropout,
                    is_causal=causal,
                    scale=self.softmax_scale * (softmax.scale or 1),
                    enable_gqa=k.shape[1] != q.shape[1],
                )  # [b, heads, sq, value dim]
            if covered is not None:
                groups = q.shape[1] // v.shape[1]
                mean = v.mean(dim=2, keepdim=True).repeat_interleave(groups, dim=1)  # [b, heads, 1, value dim]
                context = torch.where(covered, mean, context)
            return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    SDPACoreAttention.__name__ = SDPACoreAttention.__qualname__ = f"SDPA{cls.__name__}"
    return SDPACoreAttention
