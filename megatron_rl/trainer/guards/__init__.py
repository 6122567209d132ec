"""What stops or refuses a run: input guards, fidelity thresholds, weight-sync verification, stop signals."""
