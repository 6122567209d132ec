"""Host-side cache of per-sample routes for R2/R3, in SGLang's layout.

A sample of `n` tokens has routes `[n - 1, moe_layers, top_k]`: row t holds the experts the token at
position t was routed to (the last token is never fed to the model, so it has no row). Indices are
stored in the smallest dtype that holds every expert id (uint8 up to 256 experts, int16 beyond), on
the host, one array per sample, and each data-parallel rank keeps only the samples it trains on.
"""

from __future__ import annotations

import numpy as np
import torch


def routes_dtype(num_experts: int) -> torch.dtype:
    """uint8 when every expert id fits (<= 256 experts), else int16 (<= 32768 experts)."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    raise ValueError(f"{num_experts} experts do not fit int16 expert ids")


def padding_routes(rows: int, seq_len: int, moe_layers: int, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """`[rows, seq_len, moe_layers, top_k]` filled with experts `0..k-1`: the routes of positions that have none
    (a sample's last token, padding, dummy rows). Distinct experts, as top-k requires; what a recording routes
    such positions to, so replaying them re-runs a recorded pass bitwise. Never reaches a log-prob."""
    return torch.arange(top_k, dtype=dtype).expand(rows, seq_len, moe_layers, top_k).clone()


class RouteCache:
    """Routes per sample (key = position in the step's batch, or any hashable id), compact, on the host."""

    def __init__(self, moe_layers: int, top_k: int, num_experts: int):
        self.moe_layers, self.top_k, self.num_experts = moe_layers, top_k, num_experts
        self.dtype = routes_dtype(num_experts)
        self._routes: dict[object, torch.Tensor] = {}

    def put(self, key: object, routes: torch.Tensor | np.ndarray, *, num_tokens: int, recorded: bool = False) -> None:
        """Store `routes` `[num_tokens - 1, moe_layers, top_k]` for the sample `key` of `num_tokens` tokens.

        The row count is checked against the token count: an off-by-one between the engine's layout
        and ours is an error, not a silent shift. Routes the trainer `recorded` itself may carry more rows:
        the last token's and the padding its micro-batch fed; replaying those keeps a re-run bitwise equal
        to the recording (every expert GEMM sees the same tokens)."""
        routes = torch.as_tensor(np.asarray(routes)) if not torch.is_tensor(routes) else routes
        expected = (num_tokens - 1, self.moe_layers, self.top_k)
        rows_ok = routes.shape[0] >= expected[0] if recorded else routes.shape[0] == expected[0]
        if not rows_ok or tuple(routes.shape[1:]) != expected[1:]:
            raise ValueError(
                f"sample {key!r}: routes of shape {tuple(routes.shape)} for {num_tokens} tokens; expected "
                f"{expected} (one row per token but the last, SGLang's routed_experts layout)"
            )
        if routes.numel() and (int(routes.min()) < 0 or int(routes.max()) >= self.num_experts):
            raise ValueError(f"sample {key!r}: expert ids outside [0, {self.num_experts})")
        self._routes[key] = routes.to(self.dtype).cpu().contiguous()

    def get(self, key: object) -> torch.Tensor:
        return self._routes[key]

    def __len__(self) -> int:
        return len(self._routes)

    def __contains__(self, key: object) -> bool:
        return key in self._routes

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._routes.values())

    def batch_routes(self, keys: list, seq_len: int) -> torch.Tensor:
        """`[len(keys), seq_len, moe_layers, top_k]` for `TokenBatch.routes`: each sample's rows, then dummy
        experts `0..k-1` for its last token and padding (never reaching a log-prob). A `None` key is a row
        this rank never feeds (another data-parallel rank's): it gets dummy experts only."""
        out = padding_routes(len(keys), seq_len, self.moe_layers, self.top_k, self.dtype)
        for i, key in enumerate(keys):
            if key is None:
                continue
            if key not in self._routes:
                raise KeyError(f"no routes cached for sample {key!r}: it is not one this rank keeps")
            routes = self._routes[key]
            out[i, : routes.shape[0]] = routes
        return out
