"""Agreement between two routings of the same tokens (pure torch).

Routes are top-k expert indices `[..., layers, k]`. Slot order carries no meaning (engines return
top-k unsorted), so routings are compared as sets per (token, layer):

* `agreement`: fraction of (token, layer, slot) whose expert is also in the other routing's set;
* `token_all_layers_agree`: fraction of tokens whose expert sets are identical in every layer;
* `per_layer`: `agreement` restricted to each layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def slot_matches(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`[..., layers]`: how many of `a`'s k experts are also among `b`'s, per (token, layer)."""
    if a.shape != b.shape:
        raise ValueError(f"routings of different shapes: {tuple(a.shape)} vs {tuple(b.shape)}")
    a, b = a.long(), b.long()
    return (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).sum(-1)


@dataclass
class AgreementCounts:
    """Additive counts behind `RouteAgreement`; sum them over micro-batches and ranks, then `.result()`."""

    matches: torch.Tensor  # [layers] float64: matching slots per layer
    slots: torch.Tensor  # [layers] float64: compared slots per layer
    tokens_all_agree: float = 0.0
    tokens: float = 0.0

    @classmethod
    def zeros(cls, layers: int) -> AgreementCounts:
        return cls(torch.zeros(layers, dtype=torch.float64), torch.zeros(layers, dtype=torch.float64))

    def __add__(self, other: AgreementCounts) -> AgreementCounts:
        return AgreementCounts(
            self.matches + other.matches,
            self.slots + other.slots,
            self.tokens_all_agree + other.tokens_all_agree,
            self.tokens + other.tokens,
        )

    def to_tensor(self) -> torch.Tensor:
        """One flat float64 vector (for an all-reduce)."""
        extra = torch.tensor([self.tokens_all_agree, self.tokens], dtype=torch.float64)
        return torch.cat([self.matches, self.slots, extra])

    @classmethod
    def from_tensor(cls, vec: torch.Tensor) -> AgreementCounts:
        layers = (vec.numel() - 2) // 2
        return cls(vec[:layers].clone(), vec[layers : 2 * layers].clone(), float(vec[-2]), float(vec[-1]))

    def result(self) -> RouteAgreement:
        per_layer = (self.matches / self.slots.clamp(min=1)).tolist()
        return RouteAgreement(
            agreement=float(self.matches.sum() / max(float(self.slots.sum()), 1.0)),
            token_all_layers_agree=self.tokens_all_agree / max(self.tokens, 1.0),
            per_layer=per_layer,
            tokens=int(self.tokens),
        )


def agreement_counts(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor | None = None) -> AgreementCounts:
    """Counts for routings `a`, `b` of shape `[..., layers, k]`; `valid` (shape `[...]`, bool) selects tokens."""
    matches = slot_matches(a, b)  # [..., L]
    layers, k = a.shape[-2], a.shape[-1]
    matches = matches.reshape(-1, layers)
    if valid is not None:
        matches = matches[valid.reshape(-1).bool()]
    tokens = matches.shape[0]
    return AgreementCounts(
        matches=matches.sum(0).double(),
        slots=torch.full((layers,), float(tokens * k), dtype=torch.float64),
        tokens_all_agree=float((matches == k).all(-1).sum()),
        tokens=float(tokens),
    )


@dataclass
class RouteAgreement:
    agreement: float
    token_all_layers_agree: float
    per_layer: list[float]
    tokens: int

    def as_metrics(self, prefix: str = "routing/", layer_ids: list[int] | None = None) -> dict[str, float]:
        """`{prefix}agreement`, `{prefix}token_all_layers_agree`, `{prefix}layer_<i>_agreement` (i = global
        layer index when `layer_ids` is given, else the MoE-layer column)."""
        ids = layer_ids if layer_ids is not None else list(range(len(self.per_layer)))
        out = {f"{prefix}agreement": self.agreement, f"{prefix}token_all_layers_agree": self.token_all_layers_agree}
        out.update({f"{prefix}layer_{i}_agreement": v for i, v in zip(ids, self.per_layer, strict=True)})
        return out


def route_agreement(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor | None = None) -> RouteAgreement:
    """Agreement between routings `a` and `b` (`[..., layers, k]`) over the `valid` tokens."""
    return agreement_counts(a, b, valid).result()


def mean_route_metrics(per_pass: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each routing metric over the passes (updates) that reported it."""
    keys = sorted(set().union(*per_pass)) if per_pass else []
    return {k: sum(m[k] for m in per_pass if k in m) / sum(1 for m in per_pass if k in m) for k in keys}
