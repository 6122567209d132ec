"""Tiny, locally built Qwen3-MoE checkpoints and a character-level tokenizer.

They are what the embedded default, the examples and the tests train and score: no download, the
real HF architecture and file layout (config.json, model.safetensors, tokenizer.json), small enough
for two CPU cores.
"""

from __future__ import annotations

import json
import string
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinyQwen3MoeSpec:
    """Shape of a tiny Qwen3-MoE; defaults train in minutes on 2 CPU cores."""

    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    moe_intermediate_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    num_experts: int = 8
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    initializer_range: float = 0.05


# A larger tiny model for benchmarks (~6 M parameters, ~25 MB in fp32): compute and transfers dominate overheads.
BENCH_SPEC = TinyQwen3MoeSpec(
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    num_experts=16,
)


def build_char_tokenizer(vocab_size: int = 128):
    """A character-level `PreTrainedTokenizerFast`: special tokens, printable ASCII, then reserved fillers."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab_list = SPECIAL_TOKENS + chars
    if len(vocab_list) > vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the {len(vocab_list)} tokens the tokenizer needs")
    vocab_list += [f"<reserved_{i}>" for i in range(vocab_size - len(vocab_list))]
    vocab = {tok: i for i, tok in enumerate(vocab_list)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<pad>",
        unk_token="<pad>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def hf_config_dict(spec: TinyQwen3MoeSpec) -> dict:
    cfg = asdict(spec)
    cfg["mlp_only_layers"] = list(spec.mlp_only_layers)
    cfg.update(
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        hidden_act="silu",
        rms_norm_eps=1e-6,
        attention_bias=False,
        attention_dropout=0.0,
        use_sliding_window=False,
        router_aux_loss_coef=0.0,
        output_router_logits=False,
        eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
        pad_token_id=SPECIAL_TOKENS.index("<pad>"),
        bos_token_id=None,
    )
    return cfg


def make_tiny_qwen3_moe(out_dir: str | Path, spec: TinyQwen3MoeSpec | None = None, *, seed: int = 0) -> Path:
    """Write a randomly initialised tiny Qwen3-MoE HF checkpoint with its tokenizer to `out_dir`."""
    spec = spec or TinyQwen3MoeSpec()
    return save_random_model(out_dir, hf_config_dict(spec), spec.vocab_size, seed, asdict(spec))


def save_random_model(out_dir: str | Path, config: dict, vocab_size: int, seed: int, spec: dict) -> Path:
    """Instantiate the HF architecture with random weights and save it with the character tokenizer.

    Norm weights are perturbed away from 1 (and routers sharpened) so that a wrong weight mapping
    cannot go unnoticed.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = dict(config)
    model_type = config.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **config)
    model = AutoModelForCausalLM.from_config(hf_config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                param.normal_(0.0, 0.5)  # a router with clear preferences
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(out)
    build_char_tokenizer(vocab_size).save_pretrained(out)
    (out / "tiny_spec.json").write_text(json.dumps(spec, indent=1))
    return out
