"""`megatron-rl models`: the supported model families (HF `model_type`) and what each supports."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options


def run(args: argparse.Namespace) -> int:
    from megatron_rl.models import supported_families

    families = supported_families()
    rows = [("model_type", "HF class", "supports")]
    rows += [(f.model_type, f.hf_architecture, f.supports) for f in families]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    for model_type, architecture, supports in rows:
        print(f"{model_type:<{widths[0]}}  {architecture:<{widths[1]}}  {supports}")
    print(
        "\nEvery family: `megatron-rl logprobs` and training at any TP/SP/EP/PP(uneven)/VPP layout, routing replay "
        "R2/R3, the local engine, weight sync, HF <-> Megatron conversion.\nRollouts through SGLang: "
        "docs/model-families.md says which families SGLang 0.5.23 serves as built here."
    )
    return 0
