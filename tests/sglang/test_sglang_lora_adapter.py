"""`rollout.lora_sync=adapter`, the client side: `SGLangEngine.load_adapter` (`weight_sync.AdapterSync`) against a
fake of SGLang 0.5.23's LoRA endpoints (runs everywhere), and its request read by SGLang's own code (the `sglang`
tier: the endpoint's request type, its tensor deserialiser and `LoRAAdapter`'s weight normalisation, on CPU).
Serving the adapter (SGLang's LoRA kernels) needs a GPU: `scripts/gpu_check.sh` runs it."""

from __future__ import annotations

import base64
import json
import pickle
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from sglang_cpu_support import cpu_launch_env

from megatron_rl.config.options import LoRAOptions
from megatron_rl.config.sampling import SamplingParams
from megatron_rl.rollout.sglang.sglang_engine import SGLangEngine
from megatron_rl.rollout.sglang.sglang_server import SGLangServerError
from tests.megatron_backend.conftest import megatron_world  # noqa: F401 (the one-process Megatron world fixture)

READER = Path(__file__).parent / "scripts" / "read_lora_request.py"


class SGLangLoRAFake(BaseHTTPRequestHandler):
    """SGLang's answers as far as the adapter path goes: /load_lora_adapter_from_tensors and /unload_lora_adapter
    answer `{"success": ..., "error_message": ...}`, HTTP 400 on failure (a name already loaded, or not loaded);
    /generate one finished item; other POSTs success. Every POST is recorded as (server port, path, body)."""

    posts: list[tuple[int, str, dict]] = []
    loaded: set[tuple[int, str]] = set()

    def log_message(self, *args) -> None:
        pass

    def _send(self, obj, status: int = 200) -> None:
        raw = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        self._send({"model_path": "/nonexistent", "weight_version": "default", "dtype": "float32"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        port = self.server.server_address[1]
        type(self).posts.append((port, self.path, body))
        key = (port, body.get("lora_name", ""))
        if self.path in ("/load_lora_adapter_from_tensors", "/unload_lora_adapter"):
            loading = self.path.startswith("/load")
            if (key in self.loaded) == loading:
                self._send({"success": False, "error_message": f"LoRA {key[1]} is (not) loaded"}, 400)
                return
            self.loaded.add(key) if loading else self.loaded.discard(key)
            self._send({"success": True, "error_message": None, "loaded_adapters": None})
        elif self.path == "/generate":
            meta = {"finish_reason": {"type": "length"}, "weight_version": "v", "output_token_logprobs": [[-1.0, 5]],
                    "input_token_logprobs": [[None, 1, None], [-0.5, 2, None]]}  # fmt: skip
            self._send([{"output_ids": [5], "meta_info": meta}] if "sampling_params" in body else {"meta_info": meta})
        else:
            self._send({"success": True, "message": "ok"})


@pytest.fixture
def two_fake_servers():
    SGLangLoRAFake.posts, SGLangLoRAFake.loaded = [], set()
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), SGLangLoRAFake) for _ in range(2)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    for server in servers:
        server.shutdown()


def _adapter() -> tuple[dict[str, torch.Tensor], dict]:
    prefix = "base_model.model.model.layers.0.self_attn."
    tensors = {f"{prefix}q_proj.lora_A.weight": torch.randn(4, 8), f"{prefix}q_proj.lora_B.weight": torch.randn(16, 4)}
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 16.0, "target_modules": ["model.layers.0.self_attn.q_proj"]}
    return tensors, config


def test_the_adapter_goes_by_value_to_every_server_and_every_request_names_it(two_fake_servers: list[str]) -> None:
    engine = SGLangEngine(two_fake_servers, routed_experts_shape=(2, 2), num_experts=8, tp_size=2)
    tensors, config = _adapter()
    engine.load_adapter(tensors, config, "step-1")
    engine.load_adapter(tensors, config, "step-2")
    for url in two_fake_servers:
        port = int(url.rsplit(":", 1)[1])
        paths = [path for p, path, _ in SGLangLoRAFake.posts if p == port]
        steps = ["/unload_lora_adapter", "/load_lora_adapter_from_tensors", "/flush_cache", "/update_weight_version"]
        assert paths == steps * 2  # the first unload is refused (nothing loaded yet) and ignored
    (_, _, body), *_ = [post for post in SGLangLoRAFake.posts if post[1] == "/load_lora_adapter_from_tensors"]
    assert body.keys() == {"lora_name", "config_dict", "serialized_named_tensors", "pinned"}
    assert (body["lora_name"], body["config_dict"], body["pinned"]) == ("policy", config, False)
    assert len(body["serialized_named_tensors"]) == 2  # one copy per server TP rank
    sent = pickle.loads(base64.b64decode(body["serialized_named_tensors"][1]))
    assert sent.keys() == tensors.keys() and all(torch.equal(sent[k], tensors[k]) for k in tensors)
    versions = [b["new_version"] for _, path, b in SGLangLoRAFake.posts if path == "/update_weight_version"]
    assert versions == ["step-1"] * 2 + ["step-2"] * 2 and engine.weight_version == "step-2"
    assert engine.last_sync is not None and engine.last_sync.bytes == 4 * (4 * 8 + 16 * 4)

    engine.generate([[1, 2]], SamplingParams(max_new_tokens=1))
    engine.score_prompts([[1, 2]])
    generates = [b for _, path, b in SGLangLoRAFake.posts if path == "/generate"]
    assert len(generates) == 3 and all(b["lora_path"] == "policy" for b in generates)


def test_a_refused_adapter_leaves_the_engine_refusing_to_generate(two_fake_servers: list[str]) -> None:
    engine = SGLangEngine(two_fake_servers[:1], routed_experts_shape=(2, 2), num_experts=8)
    tensors, config = _adapter()
    engine.load_adapter(tensors, config, "step-1")
    SGLangLoRAFake.loaded.clear()  # the server lost it: the unload it was known to need is refused
    with pytest.raises(SGLangServerError, match="unload_lora_adapter answered HTTP 400"):
        engine.load_adapter(tensors, config, "step-2")
    with pytest.raises(SGLangServerError, match="refusing to generate with mixed weights"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=1))


@pytest.mark.sglang
@pytest.mark.usefixtures("megatron_world")
def test_sglang_reads_the_request_as_the_adapter_sent(
    sglang_py: str, tiny_models: dict[str, Path], two_fake_servers: list[str], tmp_path: Path
) -> None:
    """The actor's attention adapters (`lora.sync_payload.adapter_payload`, peft's names) as SGLang's endpoint
    reads them: its request type takes the body, its deserialiser gives the tensors back, and its `LoRAAdapter`
    stacks each layer's q, k, v into `qkv_proj` (A: [3r, hidden], B: [q + k + v rows, r]) beside `o_proj`, with
    scaling alpha / r: the values the trainer holds."""
    from megatron_rl.megatron_backend.lora.sync_payload import adapter_payload
    from tests.megatron_backend.lora.test_lora_adapters import _actor, _random_b

    model = tiny_models["a"]
    actor = _actor(model, LoRAOptions(rank=4, alpha=16.0, targets=("attention",)))
    _random_b(actor)
    payload = adapter_payload(actor, "")
    assert payload is not None
    tensors, config = payload
    SGLangEngine(two_fake_servers[:1], routed_experts_shape=(2, 2), num_experts=8).load_adapter(tensors, config, "v")
    (body,) = [b for _, path, b in SGLangLoRAFake.posts if path == "/load_lora_adapter_from_tensors"]
    request = tmp_path / "request.json"
    request.write_text(json.dumps(body))
    proc = subprocess.run([sglang_py, str(READER), str(request), str(model), str(tmp_path / "read.pt")],
                          env=cpu_launch_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    read = torch.load(tmp_path / "read.pt")
    assert read["targets"] == ["o_proj", "qkv_proj"] and read["scaling"] == 4.0
    for layer in range(actor.hf_config["num_hidden_layers"]):
        peft = f"base_model.model.model.layers.{layer}.self_attn."
        sgl = read["layers"][layer]
        for which in ("A", "B"):
            qkv = torch.cat([tensors[f"{peft}{p}_proj.lora_{which}.weight"] for p in "qkv"])
            assert torch.equal(sgl[f"{peft}qkv_proj.lora_{which}.weight"], qkv)
            assert torch.equal(sgl[f"{peft}o_proj.lora_{which}.weight"], tensors[f"{peft}o_proj.lora_{which}.weight"])
        assert len(sgl) == 4
