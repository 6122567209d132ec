"""Reference outputs from Hugging Face transformers for the same tokens: log-probs, entropy, top-k experts."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_score(model_dir: Path, samples: list[dict]) -> list[dict]:
    """Per sample: fp64 log-probs and entropy of the response tokens, and the per-layer top-k experts
    of every position except the last (SGLang's layout), from `transformers`' own model of the family (its routes
    recorded as the local engine records them)."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.models.architecture import route_recorder

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    caught: list[torch.Tensor] = []
    route_recorder(model.config.to_dict())(model, caught.append)
    out = []
    for sample in samples:
        ids = torch.tensor(sample["input_ids"]).unsqueeze(0)
        start = sample["response_start"]
        caught.clear()
        with torch.no_grad():
            logits = model(ids).logits[0].double()
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)[start - 1 :]
        entropy = -(logp_all.exp() * logp_all).sum(-1)[:-1][start - 1 :]
        routes = torch.stack(caught, dim=1)[:-1]  # [len - 1, moe_layers, k]
        out.append({"log_probs": logp, "entropy": entropy, "routed_experts": routes})
    return out


def assert_matches_hf(got: list[dict], ref: list[dict], tol: float = 1e-4) -> float:
    """Per-token log-probs and entropy within `tol` of transformers and the same top-k expert SETS everywhere;
    returns the largest error."""
    worst = 0.0
    for g, r in zip(got, ref, strict=True):
        lp = torch.tensor(g["log_probs"], dtype=torch.float64)
        ent = torch.tensor(g["entropy"], dtype=torch.float64)
        assert lp.shape == r["log_probs"].shape
        worst = max(worst, (lp - r["log_probs"]).abs().max().item(), (ent - r["entropy"]).abs().max().item())
        routes = torch.tensor(g["routed_experts"])
        assert routes.shape == r["routed_experts"].shape, (routes.shape, r["routed_experts"].shape)
        # The order inside a top-k row carries no meaning (megatron-core 0.19 does not sort it): compare sets.
        same = torch.equal(routes.sort(-1).values, r["routed_experts"].sort(-1).values)
        assert same, "top-k experts differ from transformers"
    assert worst < tol, f"log-prob/entropy error {worst} vs transformers"
    return worst


def make_samples(vocab: int, n: int = 5, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        length = int(torch.randint(8, 30, (1,), generator=gen))
        ids = torch.randint(4, vocab, (length,), generator=gen).tolist()
        samples.append({"input_ids": ids, "response_start": int(torch.randint(1, length, (1,), generator=gen))})
    return samples


def as_samples(rows: list[dict]) -> list:
    """`make_samples` rows as rollout `Sample`s (prompt = the tokens before `response_start`)."""
    from megatron_rl.rollout.sample import Sample

    return [
        Sample(
            prompt_ids=r["input_ids"][: r["response_start"]],
            response_ids=r["input_ids"][r["response_start"] :],
            response_log_probs=[0.0] * (len(r["input_ids"]) - r["response_start"]),
            finish_reason="stop",
            weight_version="step-0",
        )
        for r in rows
    ]


def as_token_batch(rows: list[dict]):
    """`make_samples` rows as the actor's right-padded `TokenBatch`."""
    from megatron_rl.megatron_backend.actor.batch import TokenBatch

    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.tensor([r["input_ids"] + [0] * (width - len(r["input_ids"])) for r in rows])
    return TokenBatch(ids, torch.tensor([len(r["input_ids"]) for r in rows]),
                      torch.tensor([r["response_start"] for r in rows]))  # fmt: skip
