"""A multi-token-prediction (MTP) layer added to a tiny checkpoint, as DeepSeek-V3 and GLM-4.5 checkpoints store
theirs: `model.layers.{num_hidden_layers}.` holds its projections and norms (`eh_proj`, `enorm`, `hnorm`), a whole
decoder layer and its own head (`shared_head`, `embed_tokens`). transformers does not build it; the families skip
it on load and conversions keep it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def add_mtp_layer(model_dir: Path, out_dir: Path) -> Path:
    """A copy of `model_dir` whose checkpoint also holds one random MTP layer shaped by its config.json."""
    shutil.copytree(model_dir, out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    layers, hidden, vocab = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    tensors = load_file(out_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    extra = {
        mtp + n[len(last) :]: torch.randn(t.shape, generator=gen) for n, t in tensors.items() if n.startswith(last)
    }
    for name, shape in {
        "enorm.weight": (hidden,), "hnorm.weight": (hidden,), "eh_proj.weight": (hidden, 2 * hidden),
        "shared_head.norm.weight": (hidden,), "shared_head.head.weight": (vocab, hidden),
        "embed_tokens.weight": (vocab, hidden),
    }.items():  # fmt: skip
        extra[mtp + name] = torch.randn(shape, generator=gen)
    save_file({**tensors, **extra}, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir
