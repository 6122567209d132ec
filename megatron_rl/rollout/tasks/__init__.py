"""The synthetic tasks of the embedded demos."""
