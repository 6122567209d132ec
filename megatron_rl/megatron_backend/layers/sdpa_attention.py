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
- a value head width other than the query's (MLA; 0.19.x's THD value padding): the output is heads x value width
  (narrower values are zero-padded to the query width for the kernel, CPU flash attention wanting equal widths,
  and the padding cut from the output);
- attention dropout while training, under the model-parallel RNG like the parent (the mask drawn differs: the
  kernel draws its own);
- attention sinks (`softmax_type` "learnable" or "off-by-one", GPT-OSS; `SoftmaxOne`: one more logit per head
  whose probability is dropped) as one more key with a zero value that only one more query feature, sink / scale,
  reaches, so its score is the sink (to rounding) and the mask stays boolean: the fused kernel runs in scoring and in
  training alike (a mask needing the sinks' gradient would send training to SDPA's math kernel, which rounds
  differently, and the first update's ppo_kl would not be exactly 0). A row masked entirely gives 0, as in the parent;
- sliding windows (`window_size` on the layers `window_attn_skip_freq` marks): the parent's window mask, which
  replaces any other.

What SDPA cannot express here goes to the parent's forward unchanged: an attention bias, packed sequences (the
parent refuses them; `packed_attention.packed_variant` wraps this class and calls it per length bucket), a
non-boolean mask, and cross attention with a causal mask (the parent asserts). In half precision the parent rounds
the scores to bf16/fp16 before its fp32 softmax; SDPA keeps them in fp32 inside the kernel (more accurate, not
bitwise equal).
Selected by `model.options.local_attention` (model_builder); Transformer Engine's attention is left as it is.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
import torch.nn.functional as F


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
            scale = self.softmax_scale * (softmax.scale or 1)
            if sinks is not None:
                # SoftmaxOne: one more logit per head, the sink, whose probability is dropped. It is one more key
                # with a zero value that only a further query feature, sink / scale, reaches: its score is the sink
                # (to rounding), and the mask stays boolean, so the fused kernel runs in scoring and training alike.
                heads, groups = q.shape[1], k.shape[1]
                if allowed is None:
                    allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
                    allowed = allowed.tril() if causal else allowed
                allowed = allowed.view((1,) * (4 - allowed.dim()) + tuple(allowed.shape))  # [b or 1, heads or 1, ...]
                allowed = torch.cat([allowed, allowed.new_ones(*allowed.shape[:3], 1)], dim=-1)
                causal = False
                q = torch.cat([q, (sinks.to(q.dtype) / scale).view(1, heads, 1, 1).expand(b, heads, sq, 1)], dim=-1)
                sink_key = k.new_zeros(b, groups, 1, k.shape[3] + 1)
                sink_key[..., -1] = 1
                k = torch.cat([torch.cat([k, k.new_zeros(b, groups, sk, 1)], dim=-1), sink_key], dim=2)
                v = torch.cat([v, v.new_zeros(b, groups, 1, v.shape[3])], dim=2)
            width = v.shape[-1]
            if width < q.shape[-1]:  # the CPU's fused kernel wants values as wide as queries: zero features, cut after
                v = F.pad(v, (0, q.shape[-1] - width))
            dropout = self.attention_dropout.p if self.training else 0.0
            fork = dropout > 0 and not self.config.sequence_parallel
            with tensor_parallel.get_cuda_rng_tracker().fork() if fork else contextlib.nullcontext():
                context = F.scaled_dot_product_attention(
                    q,
                    k,
                    v,
                    attn_mask=allowed,
                    dropout_p=dropout,
                    is_causal=causal,
                    scale=scale,
                    enable_gqa=k.shape[1] != q.shape[1],
                )[..., :width]  # [b, heads, sq, value dim]
            if covered is not None:
                groups = q.shape[1] // v.shape[1]
                mean = v[..., :width].mean(dim=2, keepdim=True).repeat_interleave(groups, dim=1)  # [b, heads, 1, width]
                context = torch.where(covered, mean, context)
            return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    SDPACoreAttention.__name__ = SDPACoreAttention.__qualname__ = f"SDPA{cls.__name__}"
    return SDPACoreAttention
