"""Per-layer agreement between two routings of the same tokens; prints a table and writes a PNG.

Inputs, either:
* one `.pt` file: `{"a": routes, "b": routes, "lengths": [batch], "names": ("recorded", "natural"),
  "layers": [global layer ids]}` with routes `[batch, seq, moe_layers, top_k]` (e.g. `TokenBatch.routes`
  and `ScoreResult.routes` of `compute_log_probs(record_routes=True)`, saved with `save_routes`); or
* two JSONL outputs of `megatron-rl logprobs` (one sample a line with `routed_experts`, SGLang layout
  `[tokens - 1, moe_layers, top_k]`), e.g. one scored by the rollout engine and one by the trainer.

    python tools/inspect_routes.py routes.pt --png agreement.png
    python tools/inspect_routes.py engine.jsonl trainer.jsonl --png agreement.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.routing.agreement import RouteAgreement, agreement_counts  # noqa: E402


def save_routes(path: str | Path, a: torch.Tensor, b: torch.Tensor, lengths: torch.Tensor, **meta) -> None:
    """Write the `.pt` format this tool reads (routes of one batch under two routings)."""
    torch.save({"a": a.cpu(), "b": b.cpu(), "lengths": lengths.cpu(), **meta}, path)


def _jsonl_routes(path: Path) -> list[torch.Tensor]:
    return [torch.tensor(json.loads(line)["routed_experts"]) for line in path.read_text().splitlines() if line.strip()]


def load(paths: list[Path]) -> tuple[RouteAgreement, tuple[str, str], list[int] | None]:
    if len(paths) == 1:
        data = torch.load(paths[0], weights_only=True)  # tensors, lists, strings: no code runs
        a, b, lengths = data["a"], data["b"], data["lengths"]
        valid = torch.arange(a.shape[1]).unsqueeze(0) < (lengths.unsqueeze(1) - 1)
        names = tuple(data.get("names", ("a", "b")))
        return agreement_counts(a, b, valid).result(), names, data.get("layers")
    if len(paths) != 2:
        raise SystemExit("give one .pt file or two JSONL files")
    first, second = _jsonl_routes(paths[0]), _jsonl_routes(paths[1])
    if len(first) != len(second):
        raise SystemExit(f"{paths[0]} holds {len(first)} samples, {paths[1]} {len(second)}")
    counts = None
    for i, (x, y) in enumerate(zip(first, second, strict=True)):
        if x.shape != y.shape:
            raise SystemExit(f"sample {i}: routes of shape {tuple(x.shape)} vs {tuple(y.shape)}")
        c = agreement_counts(x, y)
        counts = c if counts is None else counts + c
    return counts.result(), (paths[0].stem, paths[1].stem), None


def plot(result: RouteAgreement, names: tuple[str, str], layers: list[int], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4, 0.4 * len(layers) + 2), 3))
    ax.bar([str(i) for i in layers], result.per_layer)
    ax.set_ylim(0, 1)
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("expert agreement")
    ax.set_title(
        f"{names[0]} vs {names[1]}: {result.agreement:.3f}, all-layer tokens {result.token_all_layers_agree:.3f}"
    )
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", type=Path, help="one .pt file or two logprobs JSONL files")
    parser.add_argument("--png", type=Path, default=None, help="write a per-layer bar chart here")
    args = parser.parse_args(argv)
    result, names, layers = load(args.inputs)
    layers = layers or list(range(len(result.per_layer)))
    print(f"{names[0]} vs {names[1]}: {result.tokens} tokens")
    print(f"agreement (token, layer, slot)  {result.agreement:.4f}")
    print(f"tokens agreeing in all layers   {result.token_all_layers_agree:.4f}")
    for layer, value in zip(layers, result.per_layer, strict=True):
        print(f"layer {layer:>3}  {value:.4f}")
    if args.png is not None:
        plot(result, names, layers, args.png)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
