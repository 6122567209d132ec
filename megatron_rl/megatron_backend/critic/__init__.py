"""The value model (critic) of PPO with a learned baseline."""
