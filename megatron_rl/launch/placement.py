"""Which GPUs of which node each SGLang server of a job gets: the rollout servers and the frozen side models'
(`rollout.side_models` without urls), and the shell form the SLURM templates read.

Colocated jobs train on every GPU, so rollout servers share them and side models cannot be launched (they are
given by their urls). Disaggregated jobs serve on the rollout nodes: each side server takes `tp` GPUs from the top of
the last node with room (ports from `SIDE_PORT` on each node), and the rollout servers fill the rest,
`rollout.sglang.tp_size` GPUs each (ports from `SGLANG_PORT`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_rl.config.side_models import launched

SGLANG_PORT = 30000
SIDE_PORT = 30300


@dataclass(frozen=True)
class RolloutServer:
    node: int
    gpus: tuple[int, ...]
    port: int


@dataclass(frozen=True)
class SideServer:
    model: int  # index into rollout.side_models
    name: str
    node: int
    gpus: tuple[int, ...]
    port: int


def place_servers(
    cfg: Any, serving: list[int], gpus_per_node: int, colocated: bool
) -> tuple[list[RolloutServer], list[SideServer], list[str], list[str]]:
    """The rollout and side servers of `cfg` (an `RLConfig`) on the `serving` nodes, the reasons it cannot be, and
    notes (side models running elsewhere, GPUs that serve nothing)."""
    models = cfg.rollout.side_models
    reasons: list[str] = []
    notes = [f"side model {m.name}: running at {', '.join(m.urls)}" for m in models if m.urls]
    todo = launched(models)
    need = sum(models[i].num_servers * models[i].tp for i in todo)
    if todo and colocated:
        names = ", ".join(models[i].name for i in todo)
        reasons.append(
            f"rollout.side_models {names} need {need} GPU(s) of their own (num_servers x tp), but a colocated job "
            "trains on every GPU: give their urls (servers run elsewhere), or set trainer.colocate=false so that the "
            "rollout nodes serve them"
        )
        todo = []
    free = {node: gpus_per_node for node in serving}
    ports = dict.fromkeys(serving, SIDE_PORT)
    side: list[SideServer] = []
    for i in todo:
        m = models[i]
        for _ in range(m.num_servers):
            node = next((n for n in reversed(serving) if free[n] >= m.tp), None)
            if node is None:
                reasons.append(
                    f"rollout.side_models {m.name} needs {m.num_servers} server(s) of tp={m.tp} GPUs on one node, but "
                    f"the rollout nodes ({len(serving)} x {gpus_per_node} GPUs) have no room left (side models take "
                    f"{need}): add rollout nodes, or lower its num_servers or tp"
                )
                break
            side.append(SideServer(i, m.name, node, tuple(range(free[node] - m.tp, free[node])), ports[node]))
            free[node] -= m.tp
            ports[node] += 1
    rollout: list[RolloutServer] = []
    tp = cfg.rollout.sglang.tp_size
    if not serving:
        return rollout, side, reasons, notes
    if gpus_per_node % tp:
        reasons.append(
            f"rollout.sglang.tp_size={tp} does not divide {gpus_per_node} GPUs per node: a server must fit on one node"
        )
        return rollout, side, reasons, notes
    for node in serving:
        for k in range(free[node] // tp):
            rollout.append(RolloutServer(node, tuple(range(k * tp, (k + 1) * tp)), SGLANG_PORT + k))
    if not rollout:
        reasons.append(
            f"no rollout server fits: the side models take {need} of the {len(serving) * gpus_per_node} rollout GPUs "
            f"and a rollout server needs rollout.sglang.tp_size={tp}: add rollout nodes"
        )
    idle = {node: free[node] % tp for node in serving if free[node] % tp}
    if idle:
        notes.append(
            f"{sum(idle.values())} rollout GPU(s) serve nothing: the side models leave fewer than "
            f"rollout.sglang.tp_size={tp} on node(s) {sorted(idle)}"
        )
    return rollout, side, reasons, notes


def servers_shell(cfg: Any, rollout: tuple[RolloutServer, ...], side: tuple[SideServer, ...]) -> dict[str, str]:
    """The servers as shell values: PLAN_SERVERS ("node:port:gpus" each), PLAN_SIDE_MODELS (the launched side
    models' indices), PLAN_SIDE_<i>_PATH / _TP / _MEM_FRACTION, PLAN_SIDE_SERVERS ("index:node:port:gpus")."""

    def gpus(g: tuple[int, ...]) -> str:
        return ",".join(map(str, g))

    values = {
        "PLAN_SERVERS": " ".join(f"{s.node}:{s.port}:{gpus(s.gpus)}" for s in rollout),
        "PLAN_SIDE_MODELS": " ".join(str(i) for i in sorted({s.model for s in side})),
        "PLAN_SIDE_SERVERS": " ".join(f"{s.model}:{s.node}:{s.port}:{gpus(s.gpus)}" for s in side),
    }
    for i in sorted({s.model for s in side}):
        m = cfg.rollout.side_models[i]
        values |= {f"PLAN_SIDE_{i}_PATH": m.hf_path, f"PLAN_SIDE_{i}_TP": str(m.tp),
                   f"PLAN_SIDE_{i}_MEM_FRACTION": str(m.mem_fraction_static)}  # fmt: skip
    return values


def format_servers(rollout: tuple[RolloutServer, ...], side: tuple[SideServer, ...], nodes: list[int]) -> list[str]:
    """The plan's lines for the servers."""
    out = [f"rollout: {len(rollout)} SGLang server(s) on nodes {nodes}"]
    out += [f"  node {s.node}: port {s.port}, GPUs {list(s.gpus)}" for s in rollout]
    out += [f"  side model {s.name}: node {s.node}, port {s.port}, GPUs {list(s.gpus)}" for s in side]
    return out
