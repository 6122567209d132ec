"""The SGLang client without SGLang: a contract fake of SGLang's HTTP API, a dead port and a hanging request
(runs everywhere). The real server is exercised in test_sglang_server.py (the `sglang` tier).

The fake records every request's `Authorization` header: each call the client makes must carry the key."""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from megatron_rl.config.sampling import SamplingParams
from megatron_rl.rollout.sglang.sglang_engine import SGLangEngine, sampling_params_json
from megatron_rl.rollout.sglang.sglang_server import SGLangServerError, free_port
from megatron_rl.rollout.sglang.weight_sync import (
    DiskWeightSync,
    TensorWeightSync,
    serialize_bucket,
    split_expert_buckets,
)


def _item(prompt_len: int, out: list[int], finish: dict, routes: np.ndarray | None) -> dict:
    meta = {
        "finish_reason": finish,
        "weight_version": "v7",
        "output_token_logprobs": [[-0.5 - i, t, None] for i, t in enumerate(out)],
    }
    if routes is not None:
        meta["routed_experts"] = base64.b64encode(routes.astype("<i4").tobytes()).decode()
    return {"output_ids": out, "meta_info": meta}


class SGLangHTTPContractFake(BaseHTTPRequestHandler):
    """A fake of SGLang 0.5.23's native HTTP contract, as far as `SGLangEngine` and the weight syncs use it.

    - POST /generate: reads `input_ids`, `sampling_params` (`n`) and `return_routed_experts`; answers a list of `n`
      items `{"output_ids", "meta_info": {"finish_reason": {"type": "stop"|"length"|"abort", ...},
      "weight_version", "output_token_logprobs": [[logprob, token_id, null], ...], "routed_experts"}}`, the
      routes base64 little-endian int32 `[prompt + response - 1, layers, 2]` with a column for EVERY decoder
      layer, as SGLang 0.5.23 sends them (a dense layer's column holds valid-looking ids): `layers` is
      `num_hidden_layers` of `model_path`'s config.json, else 2 (or `route_layers` when set).
    - GET /model_info (`model_path`, `weight_version`), GET /health.
    - POST /release_memory_occupation and /resume_memory_occupation (`tags`): answer `null`, as SGLang does.
    - Every other POST (/pause_generation, /continue_generation, /abort_request, /flush_cache,
      /begin_weight_update, /update_weights_from_tensor, /end_weight_update, /update_weight_version,
      /update_weights_from_disk): SGLang's success shape `{"success": true, "message": ...}`.

    With `hang` set, a POST is held (no answer) until `release` is set; `holding` is set while one is held."""

    hang = False
    model_path = "/nonexistent"  # /model_info's answer
    route_layers: int | None = None  # columns per position of the routes, overriding the served config's
    bodies: list[dict] = []
    memory_calls: list[tuple[str, list[str]]] = []
    auth: list[tuple[str, str | None]] = []  # (path, Authorization header) of every request
    holding = threading.Event()
    release = threading.Event()

    def log_message(self, *args) -> None:
        pass

    def _send(self, obj) -> None:
        raw = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _served_layers(self) -> int:
        config = Path(self.model_path) / "config.json"
        return json.loads(config.read_text())["num_hidden_layers"] if config.exists() else 2

    def do_GET(self) -> None:
        type(self).auth.append((self.path, self.headers.get("Authorization")))
        self._send({"model_path": self.model_path, "weight_version": "v7"})

    def do_POST(self) -> None:
        type(self).auth.append((self.path, self.headers.get("Authorization")))
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.hang:
            type(self).holding.set()
            type(self).release.wait(60)  # the fixture's teardown sets it
            return
        if self.path in ("/release_memory_occupation", "/resume_memory_occupation"):  # SGLang answers null
            type(self).memory_calls.append((self.path, body["tags"]))
            self._send(None)
            return
        if self.path != "/generate":  # weight updates, pause, abort, flush: SGLang's success shape
            self._send({"success": True, "message": "ok"})
            return
        type(self).bodies.append(body)
        prompt, n = body["input_ids"], body["sampling_params"]["n"]
        routes = None
        if body.get("return_routed_experts"):
            layers = self.route_layers or self._served_layers()
            routes = np.arange((len(prompt) + 1) * layers * 2).reshape(-1, layers, 2) % 8
        finishes = [{"type": "stop", "matched": 2}, {"type": "length", "length": 2}, {"type": "abort", "message": "x"}]
        self._send([_item(len(prompt), [5, 2], finishes[j % 3], routes) for j in range(n)])


@pytest.fixture
def sglang_contract_fake_url():
    fake = SGLangHTTPContractFake
    fake.hang, fake.model_path, fake.bodies, fake.memory_calls, fake.auth = False, "/nonexistent", [], [], []
    fake.route_layers = None
    fake.holding, fake.release = threading.Event(), threading.Event()
    server = ThreadingHTTPServer(("127.0.0.1", 0), fake)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    fake.release.set()
    server.shutdown()


def test_generate_decodes_contract(sglang_contract_fake_url):
    engine = SGLangEngine([sglang_contract_fake_url], routed_experts_shape=(2, 2), num_experts=8)
    assert engine.weight_version == "v7"
    params = SamplingParams(max_new_tokens=2, temperature=0.7, stop_token_ids=(9,), seed=3)
    samples = engine.generate([[1, 2, 3], [4]], params, n=3, return_routed_experts=True)
    assert [s.group_index for s in samples] == [0, 0, 0, 1, 1, 1]
    assert [s.finish_reason for s in samples[:3]] == ["stop", "length", "abort"]
    assert samples[0].response_ids == [5, 2] and samples[0].response_log_probs == [-0.5, -1.5]
    assert samples[0].routed_experts.dtype == np.uint8 and samples[0].routed_experts.shape == (4, 2, 2)
    assert samples[3].routed_experts.shape == (2, 2, 2)
    sent = SGLangHTTPContractFake.bodies[0]["sampling_params"]
    assert sent == sampling_params_json(params, 3)
    assert sent["sampling_seed"] == 3 and sent["stop_token_ids"] == [9] and "seed" not in sent


def test_dead_server_clear_error_fast():
    url = f"http://127.0.0.1:{free_port()}"
    engine = SGLangEngine([url], request_timeout_s=30, control_timeout_s=2)
    with pytest.raises(SGLangServerError, match="unreachable") as err:  # refused at once, not timed out
        engine.generate([[1]], SamplingParams())
    assert "did not answer" not in str(err.value)
    assert not engine.healthy()


def test_hanging_request_times_out(sglang_contract_fake_url):
    engine = SGLangEngine([sglang_contract_fake_url], request_timeout_s=1, control_timeout_s=1)
    SGLangHTTPContractFake.hang = True
    with pytest.raises(SGLangServerError, match="did not answer within 1 s"):
        engine.generate([[1]], SamplingParams())
    # The client gave up on its own: the server was holding the request and still is.
    assert SGLangHTTPContractFake.holding.is_set() and not SGLangHTTPContractFake.release.is_set()


def test_bucket_helpers():
    import pickle

    import torch

    bucket = [("model.layers.0.mlp.experts.0.up_proj.weight", torch.ones(2)), ("model.norm.weight", torch.zeros(3))]
    parts = list(split_expert_buckets([bucket]))
    assert [[n for n, _ in b] for b in parts] == [
        ["model.norm.weight"],
        ["model.layers.0.mlp.experts.0.up_proj.weight"],
    ]
    (name, t), _ = pickle.loads(base64.b64decode(serialize_bucket(bucket)))
    assert name == bucket[0][0] and torch.equal(t, bucket[0][1])


def test_memory_release_and_resume_follow_sglangs_contract(sglang_contract_fake_url):
    """The colocated phase order: release all after rollout, weights back for the sync, caches after it."""
    engine = SGLangEngine(
        [sglang_contract_fake_url, sglang_contract_fake_url], routed_experts_shape=(2, 2), num_experts=8
    )
    engine.release_memory()
    engine.release_memory(["kv_cache"])  # already released: no request
    with pytest.raises(RuntimeError, match="memory released"):
        engine.generate([[1]], SamplingParams())
    engine.resume_memory(["weights"])
    engine.resume_memory(["kv_cache", "cuda_graph"])
    with pytest.raises(RuntimeError, match="resumed but not updated"):
        engine.generate([[1]], SamplingParams())
    engine.memory.updated()  # what a successful update_weights does (the weight paths are tested elsewhere)
    assert len(engine.generate([[1]], SamplingParams(max_new_tokens=2))) == 1
    assert SGLangHTTPContractFake.memory_calls == [
        *[("/release_memory_occupation", ["weights", "kv_cache", "cuda_graph"])] * 2,  # one per server
        *[("/resume_memory_occupation", ["weights"])] * 2,
        *[("/resume_memory_occupation", ["kv_cache", "cuda_graph"])] * 2,
    ]


def test_every_request_carries_the_api_key(sglang_contract_fake_url, tmp_path):
    """Generation, control, memory and the tensor and disk weight paths all send `Bearer <key>`
    (the distributed path is checked against the real server, tests/sglang/test_sglang_server.py)."""
    import torch

    engine = SGLangEngine(
        [sglang_contract_fake_url, sglang_contract_fake_url],
        api_key="s3cret",
        routed_experts_shape=(2, 2),
        num_experts=8,
    )
    engine.generate([[1, 2]], SamplingParams(max_new_tokens=2), n=2)
    engine.pause(), engine.resume(), engine.abort(), engine.flush_cache()
    assert engine.healthy()
    engine.release_memory(), engine.resume_memory()
    bucket = [("model.norm.weight", torch.ones(3))]
    engine.weight_sync = TensorWeightSync()
    engine.update_weights([bucket], "v1")
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text("{}")
    engine.weight_sync = DiskWeightSync(base_model_dir=str(tmp_path / "base"))
    engine.update_weights([bucket], "v2")
    paths = {path for path, _ in SGLangHTTPContractFake.auth}
    for needed in ("/generate", "/model_info", "/health", "/pause_generation", "/continue_generation",
                   "/abort_request", "/flush_cache", "/release_memory_occupation", "/resume_memory_occupation",
                   "/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update",
                   "/update_weight_version", "/update_weights_from_disk"):  # fmt: skip
        assert needed in paths, needed
    assert {header for _, header in SGLangHTTPContractFake.auth} == {"Bearer s3cret"}


def test_no_key_no_header(sglang_contract_fake_url):
    SGLangEngine([sglang_contract_fake_url]).generate([[1]], SamplingParams(max_new_tokens=2))
    assert SGLangHTTPContractFake.auth and all(header is None for _, header in SGLangHTTPContractFake.auth)


def test_routed_experts_layout_comes_from_the_served_models_family(sglang_contract_fake_url, tmp_path):
    """Without `routed_experts_shape`/`num_experts`, the layout is the served config.json's `ModelDims`: 2 layers
    x top-2 rows; 300 experts do not fit uint8 ids, so routes are stored as int16."""
    from megatron_rl.tiny_model import TinyQwen3MoeSpec, hf_config_dict

    config = hf_config_dict(TinyQwen3MoeSpec(num_hidden_layers=2, num_experts=300, num_experts_per_tok=2))
    (tmp_path / "config.json").write_text(json.dumps(config))
    SGLangHTTPContractFake.model_path = str(tmp_path)
    engine = SGLangEngine([sglang_contract_fake_url])
    samples = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2), return_routed_experts=True)
    routes = samples[0].routed_experts
    assert routes.dtype == np.int16 and routes.shape == (4, 2, 2)
    np.testing.assert_array_equal(routes.reshape(-1), np.arange(16) % 8)  # the fake's ids, decoded in order
    SGLangHTTPContractFake.model_path = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="pass routed_experts_shape= and num_experts="):
        SGLangEngine([sglang_contract_fake_url]).generate([[1]], SamplingParams(), return_routed_experts=True)


def test_routed_experts_keep_the_moe_layers_columns(sglang_contract_fake_url, tmp_path):
    """SGLang sends a column for every decoder layer; with `mlp_only_layers=[1]` of 3 layers the dense middle
    column is dropped and the MoE layers' columns 0 and 2 are kept in order, `[T-1, 2, top_k]`."""
    from megatron_rl.tiny_model import TinyQwen3MoeSpec, hf_config_dict

    spec = TinyQwen3MoeSpec(num_hidden_layers=3, mlp_only_layers=(1,), num_experts=8, num_experts_per_tok=2)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(spec)))
    SGLangHTTPContractFake.model_path = str(tmp_path)
    engine = SGLangEngine([sglang_contract_fake_url])
    routes = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2), return_routed_experts=True)[0]
    sent = np.arange(4 * 3 * 2).reshape(4, 3, 2) % 8  # the fake's every-layer ids
    assert routes.routed_experts.dtype == np.uint8 and routes.routed_experts.shape == (4, 2, 2)
    np.testing.assert_array_equal(routes.routed_experts, sent[:, [0, 2]])
    assert not np.array_equal(sent[:, 1], sent[:, 0]) and not np.array_equal(sent[:, 1], sent[:, 2])

    SGLangHTTPContractFake.route_layers = 2  # a server that sends the MoE layers only: kept as sent
    routes = SGLangEngine([sglang_contract_fake_url]).generate(
        [[1, 2, 3]], SamplingParams(max_new_tokens=2), return_routed_experts=True
    )[0]
    np.testing.assert_array_equal(routes.routed_experts, np.arange(16).reshape(4, 2, 2) % 8)

    SGLangHTTPContractFake.route_layers = 5  # neither layout: refused, naming both
    with pytest.raises(SGLangServerError, match=r"neither \[4, 3, 2\] \(every decoder layer\) nor \[4, 2, 2\]"):
        SGLangEngine([sglang_contract_fake_url]).generate(
            [[1, 2, 3]], SamplingParams(max_new_tokens=2), return_routed_experts=True
        )


def test_null_log_prob_from_the_server_is_a_clear_error() -> None:
    """SGLang writes a NaN log-prob as JSON null: the engine names it instead of failing in float(None)."""
    engine = object.__new__(SGLangEngine)  # _to_sample reads only its arguments when no routes are asked for
    item = {
        "output_ids": [5, 6],
        "meta_info": {"output_token_logprobs": [[-0.5, 5, None], [None, 6, None]], "finish_reason": {"type": "stop"}},
    }
    with pytest.raises(SGLangServerError, match="null \\(NaN\\) log-prob"):
        engine._to_sample([1, 2], item, 0, False)


def test_deepseek_v3_routes_keep_the_layers_after_the_first_k_dense(sglang_contract_fake_url, tmp_path):
    """DeepSeek-V3 (and GLM-4.5): SGLang sends a column for each of the `first_k_dense_replace` dense layers too;
    the engine keeps the MoE layers' columns, per the family's own layer pattern."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "deepseek_v3", num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=16, num_experts_per_tok=2,
        n_group=1, topk_group=1,
    ).to_dict()  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    SGLangHTTPContractFake.model_path = str(tmp_path)
    routes = SGLangEngine([sglang_contract_fake_url]).generate(
        [[1, 2, 3]], SamplingParams(max_new_tokens=2), return_routed_experts=True
    )[0]
    sent = np.arange(4 * 3 * 2).reshape(4, 3, 2) % 8  # the fake's every-layer ids
    assert routes.routed_experts.shape == (4, 2, 2)
    np.testing.assert_array_equal(routes.routed_experts, sent[:, [1, 2]])
