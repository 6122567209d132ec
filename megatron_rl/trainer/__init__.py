"""The RL training loop and its parts: sample -> token batch, the RL loss, metrics, the loop itself."""
