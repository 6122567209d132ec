"""Evaluation of a policy on held-out datasets: per-dataset metrics (mean@k, pass@k, maj@k) and their runner."""
