"""float64 oracle and random cases shared by the kernel tests and the gloo script."""

from __future__ import annotations

import torch


def reference(
    logits: torch.Tensor,
    targets: torch.Tensor,
    w_logprobs: torch.Tensor,
    w_entropy: torch.Tensor,
    *,
    valid_vocab_size: int | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 log-probs, entropy (``0 log 0 = 0``) and d(sum w_lp lp + w_H H)/dlogits; padding gets grad 0."""
    x = logits.detach().double().requires_grad_()
    valid = x.shape[-1] if valid_vocab_size is None else valid_vocab_size
    log_p = torch.log_softmax(x[..., :valid] / temperature, dim=-1)
    logprobs = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    p = log_p.exp()
    entropy = -(p * torch.where(p > 0, log_p, 0.0)).sum(-1)  # no 0 * -inf, in the value or the gradient
    (grad,) = torch.autograd.grad((w_logprobs * logprobs + w_entropy * entropy).sum(), x)
    return logprobs.detach(), entropy.detach(), grad


def make_case(
    shape: tuple[int, ...],
    vocab: int,
    *,
    seed: int,
    valid_vocab_size: int | None = None,
    masked_fraction: float = 0.0,
    masked_tail: int = 0,
) -> dict:
    """Random logits ``3 randn``, ``-inf`` at a random fraction and on the last ``masked_tail`` columns."""
    gen = torch.Generator().manual_seed(seed)
    valid = vocab if valid_vocab_size is None else valid_vocab_size
    logits = 3 * torch.randn(*shape, vocab, generator=gen)
    if masked_fraction:
        logits.masked_fill_(torch.rand(logits.shape, generator=gen) < masked_fraction, -torch.inf)
    if masked_tail:
        logits[..., vocab - masked_tail :] = -torch.inf
    targets = torch.randint(0, valid - masked_tail if masked_tail else valid, shape, generator=gen)
    logits.scatter_(-1, targets.unsqueeze(-1), 3 * torch.randn(*shape, 1, generator=gen))  # targets stay finite
    return {
        "logits": logits,
        "targets": targets,
        "w_logprobs": torch.randn(*shape, generator=gen),
        "w_entropy": torch.randn(*shape, generator=gen),
        "valid_vocab_size": valid_vocab_size,
    }
