"""What a run writes: the run folder, metrics, sample logs and plots."""
