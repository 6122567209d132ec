"""The critic: a Megatron-Core model of the policy's family whose output layer is a scalar value head.

`MegatronCritic` is a `MegatronActor` (same layout, micro-batching, packing, pipeline schedules, DDP, optimizer,
offload and checkpoint parts) whose model ends in `ValueHead` instead of the vocabulary projection, so
`compute_values` and `train_step` run the actor's own passes: where the actor reads log-probs from the logits at
position t - 1, the critic reads the value of the state before token t (`values[:, t]` = the head's output at
t - 1, position 0 is 0), the alignment of every per-token field (`TokenBatch`).

The head is replicated over tensor-parallel ranks: under sequence parallelism it gathers the sequence first (its
backward keeps each rank's own part, since every rank computes the same values), so its gradient is whole on every
rank and its parameter is counted once in the grad norm (Megatron counts a parameter without
`tensor_model_parallel` on TP rank 0 only). Routing replay is off for the critic: its routers route for themselves.

Weights: the backbone from an HF checkpoint of the family (the language-model head unused); the head from its
`score.weight` (a reward model saved by transformers' `*ForSequenceClassification` with one label) when the
checkpoint has one, else drawn from N(0, initializer_range²) by a fixed seed, the same in every layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from megatron_rl.megatron_backend.actor.batch import TokenBatch
from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
from megatron_rl.megatron_backend.weights import hf_weights
from megatron_rl.models.family import HFConfig, WeightMismatchError
from megatron_rl.parallel_layout import ParallelLayout

SCORE = "score.weight"  # a transformers sequence-classification (reward) model's head
_HEAD_SEED = 20_24_05_04  # the fresh head's draw: fixed, so every layout and rank starts from the same head


class ValueHead(nn.Module):
    """`V(h) = w · h`: the scalar head in the place of GPTModel's `output_layer` (called as the output layer is)."""

    def __init__(self, hidden_size: int, sequence_parallel: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size))
        self.weight.not_in_hf_map = True  # type: ignore[attr-defined]  # hf_weights.local_params skips it
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return nn.functional.linear(hidden, self.weight.to(hidden.dtype)), None


class MegatronCritic(MegatronActor):
    """A value model on this rank's share of the actor's parallel layout (`MegatronActor`'s constructor
    arguments; no LoRA)."""

    @classmethod
    def from_hf(cls, model_dir: str | Path, layout: ParallelLayout, *, hf: HFConfig | None = None,
                **kwargs: Any) -> MegatronCritic:  # fmt: skip
        """The critic of the checkpoint in `model_dir` (`load_hf`)."""
        critic = super().from_hf(model_dir, layout, hf=hf, **kwargs)
        assert isinstance(critic, MegatronCritic)
        return critic

    def __init__(self, hf_config: HFConfig, layout: ParallelLayout, *args: Any, **kwargs: Any):
        # The head replaces the output layer, so nothing may tie it to the input embedding.
        super().__init__({**hf_config, "tie_word_embeddings": False}, layout, *args, **kwargs)
        self.source_config = hf_config

    def _build_chunks(self, hf_config: HFConfig, layout: ParallelLayout) -> tuple[list[Any], Any]:
        chunks, config = super()._build_chunks(hf_config, layout)
        for chunk in chunks:
            if getattr(chunk, "post_process", False):
                chunk.output_layer = ValueHead(config.hidden_size, bool(config.sequence_parallel))
        return chunks, config

    def load_hf(self, model_dir: str | Path, *, hf: HFConfig | None = None) -> None:
        """The backbone from `model_dir` (its LM head unused) and the head from its `score.weight`, else a fresh
        head (module docstring)."""
        self._check_resident("load_hf")
        index = hf_weights.SafetensorsIndex(Path(model_dir))
        head = index.get(SCORE) if SCORE in index.names() else None
        hf_weights.load_hf_weights(
            self.modules, model_dir, self.family, self.hf_config, also_present=frozenset({SCORE, "lm_head.weight"})
        )
        hidden = self.dims.hidden_size
        if head is not None and tuple(head.shape) != (1, hidden):
            raise WeightMismatchError(
                f"{model_dir}: {SCORE} has shape {tuple(head.shape)}, a value head needs (1, {hidden}): a reward "
                "model with one label (num_labels=1), or a policy checkpoint without score.weight"
            )
        if head is None:
            std = float(self.source_config.get("initializer_range", 0.02))
            head = torch.randn(1, hidden, generator=torch.Generator().manual_seed(_HEAD_SEED)) * std
        with torch.no_grad():
            for module in self.modules:
                layer: Any = module.output_layer if getattr(module, "post_process", False) else None
                if isinstance(layer, ValueHead):
                    layer.weight.copy_(head.to(layer.weight.dtype))
        if self.optimizer is not None:
            self.reload_main_params()

    def export_hf(self, *, bucket_bytes: int = 512 << 20, dtype: torch.dtype | None = None, only: Any = None):
        raise NotImplementedError("the critic is not a policy: it has no HF language-model export")

    def _packed_stats(self, mb: TokenBatch, logits: torch.Tensor, with_entropy: bool, temperature: float):
        """The values `[rows, seq]` as the model saw the tokens: position t holds the head's output at t - 1."""
        values = torch.zeros(logits.shape[:2], dtype=logits.dtype, device=logits.device)
        values[:, 1:] = logits[:, :-1, 0]
        return values, None

    def _student_topk(self, mb: TokenBatch, logits: torch.Tensor, logp: torch.Tensor) -> None:
        return None

    def compute_values(self, batch: TokenBatch) -> torch.Tensor:
        """Per-token values `[batch, seq]` aligned with `batch.input_ids` (position 0 and padding 0); for a batch
        with `dp_share`, this rank's rows (`MegatronActor.compute_log_probs`)."""
        return self.compute_log_probs(batch).log_probs
