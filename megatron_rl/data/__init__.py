"""Dataset files without a model or tokenizer: reading rows from files and folders, reading fields of a row, and
the weighted mixture of several streams. Rollout (prompts) and the SFT warm-up build on these."""
