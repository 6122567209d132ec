"""Reference outputs from Hugging Face transformers for the same tokens: log-probs, entropy, top-k experts."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_score(model_dir: Path, samples: list[dict]) -> list[dict]:
    """Per sample: fp64 log-probs and entropy of the response tokens, and the per-layer top-k experts
    of every position except the last (SGLang's layout), from `transformers`' own Qwen3-MoE."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    top_k = model.config.num_experts_per_tok
    caught: list[torch.Tensor] = []

    def hook(_module, _inputs, output):
        if isinstance(output, tuple):  # transformers >= 5: (router_logits, scores, indices)
            caught.append(output[2])
        else:  # older: the gate is a Linear returning logits
            caught.append(torch.topk(torch.softmax(output.float(), -1), top_k, dim=-1).indices)

    for name, module in model.named_modules():
        if name.endswith(("mlp.gate", "block_sparse_moe.gate")):
            module.register_forward_hook(hook)
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


def make_samples(vocab: int, n: int = 5, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        length = int(torch.randint(8, 30, (1,), generator=gen))
        ids = torch.randint(4, vocab, (length,), generator=gen).tolist()
        samples.append({"input_ids": ids, "response_start": int(torch.randint(1, length, (1,), generator=gen))})
    return samples
