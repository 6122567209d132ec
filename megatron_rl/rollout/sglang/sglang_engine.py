"""`SGLangEngine`: rollout on SGLang 0.5.23 servers over their native HTTP API.

- generate: one `/generate` request per prompt with `input_ids`, `sampling_params.n`, `return_logprob` and
  (optionally) `return_routed_experts`, sent concurrently; prompts go round-robin to the servers (or all to the
  router when there is one). SGLang batches concurrent requests itself. Samples come back grouped prompt by
  prompt. The stop token is kept in `response_ids` (SGLang includes it in `output_ids`).
- log-probs: SGLang's `output_token_logprobs` (temperature-scaled unless `SGLANG_RETURN_ORIGINAL_LOGPROB`).
- routed experts: `meta_info.routed_experts`, base64 little-endian int32 `[prompt+response-1, num_hidden_layers,
  top_k]`: SGLang 0.5.23 sends a column for every decoder layer, and a dense layer's column holds stale ids. The
  MoE layers' columns (the family's `ModelDims.moe_layers`, in layer order) are kept, `[rows, moe_layers, top_k]`
  as `LocalEngine` and the trainer record them, stored as `routing.cache.routes_dtype` (uint8 for <= 256
  experts, else int16).
- pause/resume/abort go to every server directly (the router does not proxy them).
- release_memory/resume_memory (colocated runs; servers launched with `--enable-memory-saver`, CUDA only):
  `/release_memory_occupation` / `/resume_memory_occupation` on every server, state kept by `EngineMemory`.
- update_weights: delegated to a `weight_sync` strategy (tensor / distributed / disk).
- load_adapter (`rollout.lora_sync=adapter`, servers launched with `--enable-lora`): the policy's LoRA adapter
  (`weight_sync.AdapterSync`); from then on every /generate names it (`lora_path`).
- errors: a dead server or a request that hangs raises `SGLangServerError` within `request_timeout_s`.
- auth: every request (generate, control, weight sync) carries the servers' API key (`servers.api_key`).
"""

from __future__ import annotations

import base64
import itertools
import logging
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_rl.config.sampling import SamplingParams
from megatron_rl.models.architecture import ModelDims, model_dims
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.rollout.engine import NamedTensorBucket, ServedScores
from megatron_rl.rollout.engines.engine_memory import EngineMemory
from megatron_rl.rollout.sample import FinishReason, Sample
from megatron_rl.rollout.sglang.sglang_server import SGLangServerError, SGLangServers, is_healthy, request_json
from megatron_rl.rollout.sglang.sync_paths import make_weight_sync
from megatron_rl.rollout.sglang.weight_sync import ADAPTER_NAME, AdapterSync, SyncReport, WeightSync
from megatron_rl.routing.cache import routes_dtype

logger = logging.getLogger(__name__)

_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass(frozen=True)
class _RoutesLayout:
    """What SGLang's routed-experts rows hold and which of their columns R3 replays."""

    served_layers: int  # columns per position SGLang sends: every decoder layer
    moe_layers: tuple[int, ...]  # the columns kept, in layer order
    top_k: int
    num_experts: int  # picks the storage dtype


class SGLangEngine:
    """Implements `RolloutEngine` on one or more SGLang servers."""

    def __init__(
        self,
        servers: SGLangServers | list[str],
        *,
        api_key: str | None = None,
        weight_sync: WeightSync | str = "tensor",
        request_timeout_s: float = 600.0,
        control_timeout_s: float = 60.0,
        pause_mode: str = "retract",
        max_concurrent_requests: int = 256,
        routed_experts_shape: tuple[int, int] | None = None,
        num_experts: int | None = None,
        stop_on_eos: bool = True,
        extra_sampling_params: dict[str, Any] | None = None,
        tp_size: int = 1,
    ):
        """`servers`: launched/connected `SGLangServers` or plain URLs (then `api_key` is their key).

        `weight_sync`: "tensor" | "distributed" | "disk" or a configured strategy (see `weight_sync.py`).
        `request_timeout_s`: longest a /generate request may take; `control_timeout_s`: other endpoints.
        `pause_mode`: SGLang's /pause_generation mode ("retract" keeps requests and allows /flush_cache).
        `routed_experts_shape`: (layers, top_k) of the routed-experts rows of a model whose layers are all MoE
        (every column is kept); when None, the served model's config.json (via /model_info) gives the layer
        count, the MoE layers and top-k. `num_experts` picks the storage dtype (read likewise).
        `stop_on_eos`: also stop at the model's EOS (SGLang's `ignore_eos=false`), as `LocalEngine`.
        `extra_sampling_params`: further SGLang sampling keys sent with every request (e.g. `min_new_tokens`).
        `tp_size`: each server's tensor-parallel size (the copies of a LoRA adapter's payload it takes).
        """
        self.servers = (
            servers if isinstance(servers, SGLangServers) else SGLangServers.connect(list(servers), api_key=api_key)
        )
        self.weight_sync = make_weight_sync(weight_sync) if isinstance(weight_sync, str) else weight_sync
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.pause_mode = pause_mode
        self._pool = ThreadPoolExecutor(max_concurrent_requests, thread_name_prefix="sglang")
        self._next_server = itertools.count()
        self._routed_shape = routed_experts_shape
        self._num_experts = num_experts
        self._routes_layout: _RoutesLayout | None = None
        self._extra_sampling = {**(extra_sampling_params or {}), **({} if stop_on_eos else {"ignore_eos": True})}
        self._version = self._read_version()
        self.last_sync: SyncReport | None = None
        self._stale: str | None = None  # why the served weights are unknown (a failed update)
        self.adapters = AdapterSync(tp_size=tp_size)
        self._adapter: str | None = None  # the LoRA adapter requests name (`load_adapter`)
        self.memory = EngineMemory()
        self.generated_tokens = 0  # running count, for throughput metrics

    @property
    def urls(self) -> list[str]:
        return self.servers.urls

    @property
    def _key(self) -> str | None:
        return self.servers.api_key

    # ------------------------------------------------------------------ RolloutEngine
    @property
    def weight_version(self) -> str:
        return self._version

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, n: int = 1, return_routed_experts: bool = False
    ) -> list[Sample]:
        """`n` samples per prompt, grouped prompt by prompt (sample i*n+j is prompt i's j-th)."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if self._stale is not None:
            raise SGLangServerError(f"refusing to generate with mixed weights: {self._stale}; recover() and update")
        self.memory.check_can_generate()
        if return_routed_experts:
            self._routed_experts_layout()  # fail before sending anything
        futures = [
            self._pool.submit(self._generate_one, list(prompt), params, n, return_routed_experts, i)
            for i, prompt in enumerate(prompts)
        ]
        samples: list[Sample] = []
        errors: list[BaseException] = []
        for fut in futures:
            try:
                samples.extend(fut.result())
            except BaseException as err:  # collect, so no request is left running unobserved
                errors.append(err)
        if errors:
            raise errors[0]
        self.generated_tokens += sum(len(s.response_ids) for s in samples)
        return samples

    def update_weights(self, buckets: Iterable[NamedTensorBucket], version: str) -> None:
        """Stream HF-named full tensors to every server with the configured path; later samples carry `version`."""
        self.memory.check_can_update()
        try:
            self.last_sync = self.weight_sync.update(
                self.urls, buckets, version, timeout_s=self.request_timeout_s, api_key=self._key
            )
        except SGLangServerError as err:
            self._stale = f"the update to weights {version!r} failed ({err})"
            raise
        self._stale = None
        self.memory.updated()
        self._version = version
        logger.info("weights %s: %s", version, self.last_sync)

    def load_adapter(self, tensors: dict[str, torch.Tensor], config: dict[str, Any], version: str) -> None:
        """Serve this LoRA adapter (peft's names, its adapter_config.json) on the servers' base from now on, in place
        of the last one; later samples carry `version`."""
        self.memory.check_can_update()
        try:
            self.last_sync = self.adapters.update(
                self.urls, tensors, config, version, timeout_s=self.request_timeout_s, api_key=self._key
            )
        except SGLangServerError as err:
            self._stale = f"loading the adapter of {version!r} failed ({err})"
            raise
        self._stale, self._adapter, self._version = None, ADAPTER_NAME, version
        logger.info("adapter %s: %s", version, self.last_sync)

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Free the servers' GPU memory of `tags` ("weights", "kv_cache", "cuda_graph"; None = all). Released
        weights are discarded (unless the servers keep a CPU backup): after `resume_memory` they need
        `update_weights`."""
        todo = self.memory.releasable(tags)
        if todo:
            self._broadcast("/release_memory_occupation", {"tags": list(todo)})
            self.memory.mark_released(todo)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Re-allocate the released memory of `tags` (None = all released) on every server."""
        todo = self.memory.resumable(tags)
        if todo:
            self._broadcast("/resume_memory_occupation", {"tags": list(todo)})
            self.memory.mark_resumed(todo)

    def pause(self) -> None:
        """Stop scheduling on every server (`/pause_generation`, mode `pause_mode`) until `resume()`."""
        self._broadcast("/pause_generation", {"mode": self.pause_mode})

    def resume(self) -> None:
        self._broadcast("/continue_generation", {})

    def abort(self) -> None:
        """Abort every request on every server; in-flight generate calls return samples with finish "abort"."""
        self._broadcast("/abort_request", {"abort_all": True})

    def healthy(self) -> bool:
        return all(is_healthy(url, timeout_s=self.control_timeout_s, api_key=self._key) for url in self.urls)

    def recover(self) -> list[str]:
        """Restart every launched server that is dead or does not answer `/health` within `control_timeout_s`.

        The restarted servers serve `model_path` again (weight version reset), and after a failed update the
        others hold mixed weights: the caller re-sends the current weights. A broadcast group is rebuilt on the
        next update. Connected servers cannot be restarted here.
        """
        failed = [
            i for i, url in enumerate(self.urls)
            if not self.servers.alive(i) or not is_healthy(url, timeout_s=self.control_timeout_s, api_key=self._key)
        ]  # fmt: skip
        if failed and self.servers.config is None:
            raise SGLangServerError(
                f"SGLang servers {[self.urls[i] for i in failed]} are down and were not launched by this run: "
                "restart them, or let the trainer launch them (leave rollout.sglang.urls empty)"
            )
        for i in failed:
            logger.warning("restarting SGLang server %d (%s); log tail:\n%s", i, self.urls[i], self.servers.log_tail(i))
            self.servers.restart(i)
        if failed or self._stale is not None:
            live = [u for i, u in enumerate(self.urls) if i not in failed]
            self.weight_sync.reset(live, api_key=self._key)
            self.adapters.reset(live)
            self._adapter = None  # until the caller sends it again
            self._version = self._read_version()
            self._stale = None  # the caller re-sends the weights next
        if failed:
            self.memory.reset()
        return [self.urls[i] for i in failed]

    def shutdown(self) -> None:
        """Stop the servers launched by this process (connected servers keep running)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.servers.config is not None:
            self.servers.stop()

    # ------------------------------------------------------------------ extras
    def score_prompts(self, prompts: list[list[int]], top_k: int = 0) -> list[ServedScores]:
        """Every server's teacher-forced log-probs (temperature 1) of each prompt's tokens after its first (one
        prefill-only /generate batch per server; with `top_k`, SGLang's `input_top_logprobs` of `top_k` tokens at
        each of those positions), with the weight version and dtype it reports (/model_info, /server_info)."""
        if any(len(p) < 2 for p in prompts):
            raise ValueError("every probe prompt needs at least two tokens")
        return list(self._pool.map(lambda url: self._score_on(url, prompts, top_k), self.urls))

    def _score_on(self, url: str, prompts: list[list[int]], top_k: int) -> ServedScores:
        body: dict[str, Any] = {
            "input_ids": prompts,
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        if top_k:
            body["top_logprobs_num"] = top_k
        if self._adapter:
            body["lora_path"] = self._adapter
        out = request_json(url, "/generate", body, timeout_s=self.request_timeout_s, api_key=self._key)
        items = out if isinstance(out, list) else [out]
        metas = [item["meta_info"] for item in items]
        scores = [[float(lp) for lp, _, _ in meta["input_token_logprobs"][1:]] for meta in metas]
        top_ids = top_logp = None
        if top_k:  # input_top_logprobs[t]: (log-prob, id, text) of the top_k tokens at t, None at t = 0
            rows = [meta["input_top_logprobs"][1:] for meta in metas]
            top_ids = [[[int(i) for _, i, _ in pos] for pos in row] for row in rows]
            top_logp = [[[float(lp) for lp, _, _ in pos] for pos in row] for row in rows]
        info = request_json(url, "/model_info", timeout_s=self.control_timeout_s, api_key=self._key)
        server = request_json(url, "/server_info", timeout_s=self.control_timeout_s, api_key=self._key)
        return ServedScores(
            url, str(info.get("weight_version")), str(server.get("dtype", "unknown")), scores, top_ids, top_logp
        )

    def flush_cache(self) -> None:
        self._broadcast("/flush_cache", {})

    # ------------------------------------------------------------------ internals
    def _generate_one(
        self, prompt: list[int], params: SamplingParams, n: int, want_routes: bool, group: int
    ) -> list[Sample]:
        url = self.servers.router_url or self.urls[next(self._next_server) % len(self.urls)]
        body: dict[str, Any] = {
            "input_ids": prompt,
            "sampling_params": {**sampling_params_json(params, n), **self._extra_sampling},
            "return_logprob": True,
        }
        if want_routes:
            body["return_routed_experts"] = True
        if self._adapter:
            body["lora_path"] = self._adapter
        out = request_json(url, "/generate", body, timeout_s=self.request_timeout_s, api_key=self._key)
        items = out if isinstance(out, list) else [out]
        if len(items) != n:
            raise SGLangServerError(f"SGLang {url}/generate returned {len(items)} outputs for n={n}")
        return [self._to_sample(prompt, item, group, want_routes) for item in items]

    def _to_sample(self, prompt: list[int], item: dict, group: int, want_routes: bool) -> Sample:
        meta = item["meta_info"]
        response = [int(t) for t in item["output_ids"]]
        entries = meta.get("output_token_logprobs") or []
        if any(entry[0] is None for entry in entries):  # SGLang sends NaN log-probs as null
            raise SGLangServerError(
                f"SGLang returned a null (NaN) log-prob for a generated token of group {group}: the served model "
                "computes NaN (check its weights, or that SGLang builds the same model the trainer trains)"
            )
        log_probs = [float(entry[0]) for entry in entries]
        if len(log_probs) != len(response):  # an abort can cut the two lists at different points
            keep = min(len(log_probs), len(response))
            response, log_probs = response[:keep], log_probs[:keep]
        finish = meta.get("finish_reason") or {"type": "abort"}
        reason = _FINISH.get(finish.get("type", ""))
        if reason is None:
            raise SGLangServerError(f"unknown SGLang finish_reason {finish}")
        metadata: dict[str, Any] = {}
        spans = meta.get("weight_versions") or []
        if len(spans) > 1:
            metadata["weight_versions"] = [(s["version"], s["start"], s["end"]) for s in spans]
        routed = None
        if want_routes and meta.get("routed_experts"):
            sent_rows = len(prompt) + len(item["output_ids"]) - 1  # before an abort's trim above
            routed = self._decode_routes(meta["routed_experts"], len(prompt) + len(response) - 1, sent_rows)
        return Sample(
            prompt_ids=prompt,
            response_ids=response,
            response_log_probs=log_probs,
            finish_reason=reason,
            weight_version=str(meta.get("weight_version", self._version)),
            group_index=group,
            routed_experts=routed,
            metadata=metadata,
        )

    def _decode_routes(self, encoded: str, rows: int, sent_rows: int) -> np.ndarray:
        """`[rows, moe_layers, top_k]` from SGLang's ids of every decoder layer (or of the MoE layers only) for
        `rows` to `sent_rows` positions."""
        layout = self._routed_experts_layout()
        flat = np.frombuffer(base64.b64decode(encoded), dtype="<i4")
        top_k, moe = layout.top_k, len(layout.moe_layers)
        for layers in dict.fromkeys((layout.served_layers, moe)):  # every layer first: what SGLang 0.5.23 sends
            if flat.size % (layers * top_k) == 0 and rows <= flat.size // (layers * top_k) <= max(rows, sent_rows):
                routes = flat.reshape(-1, layers, top_k)[:rows]
                if layers != moe:
                    routes = routes[:, list(layout.moe_layers)]
                return routes.astype(str(routes_dtype(layout.num_experts)).removeprefix("torch."))  # numpy's name
        raise SGLangServerError(
            f"SGLang returned {flat.size} routed-expert ids for {sent_rows} positions: neither "
            f"[{sent_rows}, {layout.served_layers}, {top_k}] (every decoder layer) nor [{sent_rows}, {moe}, {top_k}] "
            "(the MoE layers) fits"
        )

    def _routed_experts_layout(self) -> _RoutesLayout:
        if self._routes_layout is None:
            if self._routed_shape is not None:
                layers, top_k = self._routed_shape
                num_experts = self._num_experts or self._served_dims().num_experts
                self._routes_layout = _RoutesLayout(layers, tuple(range(layers)), top_k, num_experts)
            else:
                dims = self._served_dims()
                num_experts = self._num_experts or dims.num_experts
                self._routes_layout = _RoutesLayout(dims.num_layers, tuple(dims.moe_layers), dims.top_k, num_experts)
        return self._routes_layout

    def _served_dims(self) -> ModelDims:
        """The served model's `ModelDims`, from the config.json of /model_info's `model_path`."""
        info = request_json(self.urls[0], "/model_info", timeout_s=self.control_timeout_s, api_key=self._key)
        config_path = Path(info["model_path"]) / "config.json"
        if not config_path.exists():
            raise ValueError(
                f"cannot read {config_path} to learn the routed-experts layout; pass routed_experts_shape= "
                "and num_experts= to SGLangEngine"
            )
        return model_dims(read_hf_config(config_path.parent, role="the served model's model_path"))

    def _read_version(self) -> str:
        try:
            info = request_json(self.urls[0], "/model_info", timeout_s=self.control_timeout_s, api_key=self._key)
            return str(info["weight_version"])
        except (SGLangServerError, KeyError, TypeError):
            return "default"

    def _broadcast(self, path: str, body: dict) -> None:
        futures = [
            self._pool.submit(request_json, u, path, body, timeout_s=self.control_timeout_s, api_key=self._key)
            for u in self.urls
        ]
        for fut in futures:
            fut.result()


def sampling_params_json(params: SamplingParams, n: int = 1) -> dict[str, Any]:
    """The `sampling_params` object of a /generate body (only keys SGLang 0.5.23 accepts: unknown ones are 400)."""
    out: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "n": n,
    }
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.seed is not None:
        out["sampling_seed"] = params.seed
    return out
