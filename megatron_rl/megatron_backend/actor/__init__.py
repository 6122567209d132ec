"""The Megatron actor: the model, its optimizer and its forward/backward passes over this rank's micro-batches."""
