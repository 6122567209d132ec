"""Next-token sampling with SGLang's semantics, and the log-prob the engine reports for the sampled token.

Log-prob definition (what SGLang 0.5.x returns by default, `srt/layers/sampler.py`):
- temperature > 0: ``log softmax(logits / temperature)`` at the sampled token, taken *before* top-k / top-p
  truncation. Truncation only decides which tokens may be drawn; the reported value is the untruncated,
  temperature-scaled log-prob (so it can be recomputed by the trainer from logits alone).
- temperature == 0 (below 1e-6, SGLang's threshold): greedy argmax; the log-prob is ``log softmax(logits)``,
  i.e. at temperature 1, again as SGLang does.
(SGLang's `SGLANG_RETURN_ORIGINAL_LOGPROB` switch, log-probs before temperature, is not mirrored.)
"""

from __future__ import annotations

import torch

from megatron_rl.config.sampling import SamplingParams

GREEDY_TEMPERATURE = 1e-6  # SGLang treats temperature below this as greedy


def check_sampling_params(params: SamplingParams) -> None:
    """Raise ValueError on settings SGLang would reject."""
    if params.max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {params.max_new_tokens}")
    if not params.temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_k == 0 or params.top_k < -1:
        raise ValueError(f"top_k must be -1 (all) or >= 1, got {params.top_k}")


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_TEMPERATURE


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits [batch, vocab]``; return ``(tokens [batch], log_probs [batch])``.

    ``uniforms [batch]`` in [0, 1) drive inverse-CDF sampling over the sorted, truncated distribution (one draw
    per row, so a row's token depends only on its own random stream); ignored when greedy.
    """
    logits = logits.float()
    if is_greedy(params):
        log_probs = torch.log_softmax(logits, dim=-1)
        tokens = log_probs.argmax(dim=-1)
        return tokens, log_probs.gather(-1, tokens[:, None])[:, 0]
    if uniforms is None or uniforms.shape != logits.shape[:1]:
        raise ValueError(f"need one uniform per row ({logits.shape[0]}) when sampling")
    log_probs = torch.log_softmax(logits / params.temperature, dim=-1)
    probs, order = log_probs.exp().sort(dim=-1, descending=True, stable=True)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if params.top_k > 0:
        keep[:, params.top_k :] = False
    if params.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        keep &= (probs.cumsum(dim=-1) - probs) <= params.top_p
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    cdf = kept.cumsum(dim=-1)
    target = uniforms.to(cdf.dtype)[:, None] * cdf[:, -1:]
    pick = torch.searchsorted(cdf, target, right=True)
    pick = torch.minimum(pick, keep.sum(dim=-1, keepdim=True) - 1)  # guard u*total rounding to the top
    tokens = order.gather(-1, pick)[:, 0]
    return tokens, log_probs.gather(-1, tokens[:, None])[:, 0]
