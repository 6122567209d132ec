"""MoE routing replay, framework-independent parts: replay modes, the route cache, agreement math, and
`StepRoutes`, the one object an RL step uses for R2/R3.

Nothing here imports Megatron; the Megatron side (binding to routers, setting targets, recording and
observing the routes actually used) lives in `megatron_rl.megatron_backend.actor.routes` and `route_pass`.
"""
