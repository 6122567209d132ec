"""`megatron-rl launch --dry-run CONFIG [key=value ...] --nodes N --gpus-per-node G`: print the job's plan.

Which node runs what (trainer ranks with their TP/PP/DP and expert coordinates, SGLang servers, router),
the per-GPU memory estimate, and every reason an impossible plan fails. Needs no GPU, no SLURM and no
model weights: only the model's config.json (`--hf-config`, else `model.hf_path`/config.json) and a Megatron
distillation teacher's (`--teacher-hf-config`, else in `algo.distill.teacher`); every plugin the config names (rewards,
environment, tools, generate function) is resolved first. The jobs
themselves are submitted with the templates in scripts/slurm/, which print this plan first.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML training config (see examples/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, as for `megatron-rl train`")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit (the only mode)")
    parser.add_argument("--nodes", type=int, required=True, help="nodes in the job")
    parser.add_argument("--gpus-per-node", type=int, required=True, help="GPUs (trainer ranks) per node")
    parser.add_argument("--rollout-nodes", type=int, default=0, help="disaggregated: nodes that only serve SGLang")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory of one GPU (H100 80, H200 141)")
    parser.add_argument("--hf-config", help="the model's config.json (default: model.hf_path/config.json)")
    parser.add_argument(
        "--teacher-hf-config",
        help="a Megatron distillation teacher's config.json (default: algo.distill.teacher/config.json when it exists; "
        "else the teacher is planned as the student's architecture)",
    )
    parser.add_argument(
        "--emit",
        choices=["text", "shell"],
        default="text",
        help="text = the plan for people; shell = KEY=value lines the SLURM templates read",
    )


def run(args: argparse.Namespace) -> int:
    from megatron_rl.config import load_config
    from megatron_rl.launch.plan import ClusterSpec, format_plan, make_plan, shell_plan
    from megatron_rl.rollout.plugin_check import check_plugins

    if not args.dry_run:
        raise ValueError(
            "launch only plans: add --dry-run. Submit jobs with scripts/slurm/colocated.sbatch or "
            "scripts/slurm/disaggregated.sbatch (they print this plan first)"
        )
    cfg = load_config(args.config, args.overrides)  # imports the config's plugins
    # an unknown reward, environment or tool fails here, not on the cluster after the queue
    check_plugins(cfg.data, cfg.rollout)
    hf_config = Path(args.hf_config) if args.hf_config else Path(cfg.model.hf_path) / "config.json"
    if not hf_config.is_file():
        if cfg.model.build_tiny_if_missing and not args.hf_config:
            from megatron_rl.tiny_model import TinyQwen3MoeSpec, hf_config_dict

            hf = hf_config_dict(TinyQwen3MoeSpec())  # the demo's model, built on first use
        else:
            raise FileNotFoundError(f"{hf_config} not found: pass the model's config.json with --hf-config")
    else:
        hf = json.loads(hf_config.read_text())
    cluster = ClusterSpec(args.nodes, args.gpus_per_node, args.gpu_memory_gib, args.rollout_nodes)
    plan = make_plan(cfg, hf, cluster, _teacher_config(cfg, args.teacher_hf_config))
    print(shell_plan(plan, cfg) if args.emit == "shell" else format_plan(plan))
    return 0


def _teacher_config(cfg, given: str | None) -> dict | None:
    """The config.json of a teacher served by Megatron (`--teacher-hf-config`, else the teacher's folder), None when
    there is no such teacher or its folder is not on this machine."""
    distill = cfg.algo.distill
    if distill.teacher is None or distill.served_by != "megatron":
        return None
    path = Path(given) if given else Path(distill.teacher) / "config.json"
    if given and not path.is_file():
        raise FileNotFoundError(f"--teacher-hf-config {path} not found")
    return json.loads(path.read_text()) if path.is_file() else None
