"""MoE routing replay, framework-independent parts: replay modes, the route cache, agreement math.

Nothing here imports Megatron; the Megatron side (binding to routers, setting targets, observing the
routes actually used) lives in `megatron_rl.megatron_backend.routes`.
"""
