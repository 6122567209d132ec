"""Rollout: engines that generate samples (local HF engine, SGLang), rewards, dynamic sampling, prompt data."""
