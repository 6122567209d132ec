"""Launch planning for multi-node jobs (SLURM templates under scripts/slurm/ run the plan)."""
