"""Router options that silently defeat routing replay; refused when a model is built for replay."""

from __future__ import annotations

from typing import Any


def refuse_unsafe_replay_options(config: Any) -> None:
    """Raise ValueError if `config` (a Megatron TransformerConfig, or anything with its attribute names)
    enables routing replay together with an option that bypasses or undoes it."""
    if not getattr(config, "moe_enable_routing_replay", False):
        return
    fix = "or build without replay (model.options.routing_replay=false, algo.routing_replay=off)"
    if getattr(config, "moe_router_fusion", False):
        raise ValueError(
            "moe_router_fusion=True with routing replay: the fused top-k kernel returns before RouterReplay "
            f"is consulted, so replay would be silently ignored; set moe_router_fusion=False {fix}"
        )
    if getattr(config, "moe_router_load_balancing_type", None) == "sinkhorn":
        raise ValueError(
            "moe_router_load_balancing_type='sinkhorn' with routing replay: Megatron's sinkhorn routing never "
            f"passes the RouterReplay, so routes are neither recorded nor replayed; use 'aux_loss' or 'none' {fix}"
        )
    if getattr(config, "moe_expert_capacity_factor", None) is not None:
        raise ValueError(
            f"moe_expert_capacity_factor={config.moe_expert_capacity_factor} with routing replay: token dropping "
            "runs after replay and drops replayed assignments of over-full experts, so the replayed routing is "
            f"not the one used; set moe_expert_capacity_factor=None (dropless) {fix}"
        )
