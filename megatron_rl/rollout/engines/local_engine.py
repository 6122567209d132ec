"""`LocalEngine`: in-process rollout with a Hugging Face transformers model (the embedded single-machine default).

It mirrors SGLang's native /generate contract (as `SGLangEngine` reads it) so the trainer cannot tell the two apart:
- `n` samples per prompt, grouped prompt by prompt; greedy when temperature == 0;
- log-probs as defined in `rollout/engines/sampling.py` (temperature-scaled, untruncated by top-k/top-p);
- the stop token (any of `stop_token_ids`, or the model's EOS) ends a response and is kept in `response_ids`
  and its log-probs; finish_reason "stop", "length" or "abort";
- routed experts: top-k indices of every MoE router in layer order (a dense layer has no router, so no column),
  one row per fed position, `[prompt+response-1, moe_layers, k]`.

Batching: the prompts (each repeated `n` times) are decoded in chunks of `max_batch_size` rows, left-padded,
with an explicit attention mask and position ids, and a KV cache; finished rows leave the batch (and the cache).
Concurrency: one lock serialises forward steps and weight updates, so a weight update lands between two decode
steps; `pause()` holds generation at the next step boundary (SGLang's "in_place" pause) until `resume()`;
`abort()` ends every generate call in progress at its next step (unfinished samples get "abort").
`Sample.weight_version` is the version behind the last token; a sample that straddles an update also gets
`metadata["weight_versions"] = [(version, start, end), ...]` over its response tokens, like SGLang's.
Memory (colocated training, `EngineMemory`'s contract): `release_memory(["weights"])` frees the parameters'
storage and discards their values, as SGLang does; `resume_memory` re-allocates it, and the next
`update_weights` fills it. The KV cache lives only during a `generate` call and there are no CUDA graphs:
"kv_cache" and "cuda_graph" hold nothing.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from megatron_rl.config.sampling import SamplingParams
from megatron_rl.models.architecture import model_dims, route_recorder
from megatron_rl.rollout.engine import NamedTensorBucket, ServedScores
from megatron_rl.rollout.engines.engine_memory import EngineMemory
from megatron_rl.rollout.engines.hf_weight_loading import HFWeightLoader
from megatron_rl.rollout.engines.sampling import check_sampling_params, is_greedy, sample_tokens
from megatron_rl.rollout.sample import FinishReason, Sample
from megatron_rl.routing.cache import routes_dtype

logger = logging.getLogger(__name__)

_PAUSE_POLL_S = 0.02  # how often a paused generate call re-checks abort / shutdown


@dataclass
class _Row:
    """Decoding state of one sequence of a chunk."""

    prompt: list[int]
    generator: torch.Generator | None
    response: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    routes: list[torch.Tensor] = field(default_factory=list)  # per fed position: [moe_layers, top_k]
    finish: FinishReason | None = None


class LocalEngine:
    """Generates with an HF `AutoModelForCausalLM` loaded from `model_dir`; implements `RolloutEngine`."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_size: int = 64,
        weight_version: str = "default",
        stop_on_eos: bool = True,
    ):
        """`stop_on_eos`: also stop at the model's EOS tokens (SGLang's default, `ignore_eos=false`)."""
        from transformers import AutoModelForCausalLM

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype)
        # transformers wraps `to` with functools.wraps(nn.Module.to), whose stub keeps the unbound signature.
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]
        config = self.model.config
        self.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
        self.eos_token_ids = _eos_ids(self.model) if stop_on_eos else frozenset()
        self._loader = HFWeightLoader(self.model)
        self._route_sink: list[torch.Tensor] | None = None
        self._hooks = route_recorder(config.to_dict())(self.model, self._record_route)
        self._version = weight_version
        self._lock = threading.Lock()  # forward steps and weight updates
        self._running = threading.Event()
        self._running.set()
        self._abort_epoch = 0
        self._closed = False
        self._broken: str | None = None  # why the weights are in an unknown state
        self.memory = EngineMemory()
        self._weight_shapes = {p: p.shape for p in self.model.parameters()}  # tied parameters appear once
        self.generated_tokens = 0  # running count, for throughput metrics

    # ------------------------------------------------------------------ RolloutEngine
    @property
    def weight_version(self) -> str:
        return self._version

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, n: int = 1, return_routed_experts: bool = False
    ) -> list[Sample]:
        """`n` samples per prompt, grouped prompt by prompt (sample i*n+j is prompt i's j-th)."""
        self._check_open()
        self.memory.check_can_generate()
        check_sampling_params(params)
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if return_routed_experts and not self._hooks:
            raise ValueError(f"{type(self.model).__name__} has no MoE router whose top-k choices can be recorded")
        epoch = self._abort_epoch
        rows = [
            _Row(list(prompt), _sample_generator(params.seed, i * n + j))
            for i, prompt in enumerate(prompts)
            for j in range(n)
        ]
        samples: list[Sample] = []
        for start in range(0, len(rows), self.max_batch_size):
            chunk = rows[start : start + self.max_batch_size]
            versions = self._decode(chunk, params, return_routed_experts, epoch)
            for offset, row in enumerate(chunk):
                samples.append(self._to_sample(row, versions, (start + offset) // n, return_routed_experts))
        return samples

    def update_weights(self, buckets: Iterable[NamedTensorBucket], version: str) -> None:
        """Load HF-named full tensors (strict) and stamp later samples with `version`; atomic w.r.t. decoding."""
        self._check_open()
        self.memory.check_can_update()
        loaded, touched = 0, set()
        with self._lock:
            try:
                for bucket in buckets:
                    touched |= self._loader.load(bucket)  # a bucket is checked whole before any copy
                    loaded += len(bucket)
            except Exception as err:
                if loaded:
                    self._broken = f"update to weights {version!r} failed after {loaded} tensors were loaded"
                    err.add_note(f"{self._broken}: the engine holds mixed weights and reports unhealthy")
                raise
            self._version = version
            self._broken = None
            self.memory.updated()
        params = self._loader.params
        missing = len({id(p) for p in params.values()} - {id(params[name]) for name in touched})  # tied: one
        log = logger.warning if loaded == 0 else logger.info
        log("weights %s: %d tensors loaded, %d model parameters not updated", version, loaded, missing)

    @torch.inference_mode()
    def score_prompts(self, prompts: list[list[int]], top_k: int = 0) -> list[ServedScores]:
        """Teacher-forced log-probs (temperature 1) of every prompt's tokens after its first (with `top_k`, the
        `top_k` most likely tokens at each of those positions and their log-probs), in one right-padded forward pass
        under the current weights (atomic w.r.t. weight updates), and the version they are."""
        self._check_open()
        self.memory.check_can_generate()
        if any(len(p) < 2 for p in prompts):
            raise ValueError("every probe prompt needs at least two tokens")
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, : len(prompt)] = torch.tensor(prompt)
            mask[i, : len(prompt)] = 1
        with self._lock:
            self._check_open()
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            version = self._version
        full = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        rows = full.gather(-1, ids[:, 1:, None].to(self.device))[..., 0].cpu()
        scores = [rows[i, : len(p) - 1].tolist() for i, p in enumerate(prompts)]
        dtype = str(self.model.dtype).removeprefix("torch.")
        if not top_k:
            return [ServedScores("local engine", version, dtype, scores)]
        top_logp, top_ids = (t.cpu() for t in full.topk(top_k, dim=-1))
        cut = [len(p) - 1 for p in prompts]
        return [
            ServedScores(
                "local engine", version, dtype, scores,
                top_ids=[top_ids[i, :n].tolist() for i, n in enumerate(cut)],
                top_log_probs=[top_logp[i, :n].tolist() for i, n in enumerate(cut)],
            )
        ]  # fmt: skip

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Free the parameters' storage ("weights"; values discarded); "kv_cache" and "cuda_graph" hold nothing
        here (the KV cache lives only during a generate call). None = all tags."""
        self._check_open()
        with self._lock:
            todo = self.memory.releasable(tags)
            if "weights" in todo:
                for param in self._weight_shapes:
                    param.data = param.data.new_empty(0)
            self.memory.mark_released(todo)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Re-allocate what was released; resumed weights hold garbage until the next `update_weights`."""
        self._check_open()
        with self._lock:
            todo = self.memory.resumable(tags)
            if "weights" in todo:
                for param, shape in self._weight_shapes.items():
                    param.data = param.data.new_empty(shape)
            self.memory.mark_resumed(todo)

    def resident_weight_bytes(self) -> int:
        """Bytes the parameters occupy now (0 while released)."""
        return sum(param.untyped_storage().nbytes() for param in self._weight_shapes)

    def pause(self) -> None:
        """Hold generation at the next decode step (new calls wait too) until `resume()`."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def abort(self) -> None:
        """End every generate call in progress at its next step; unfinished samples get finish_reason "abort"."""
        self._abort_epoch += 1

    def healthy(self) -> bool:
        return not self._closed and self._broken is None

    def recover(self) -> list[str]:
        """Nothing runs out of process; mixed weights are repaired by the caller's next full update."""
        return []

    def shutdown(self) -> None:
        """Abort in-flight calls and free the model; later calls raise RuntimeError."""
        self._closed = True
        self.abort()
        self._running.set()
        with self._lock:
            for hook in self._hooks:
                hook.remove()
            self.model = None

    # ------------------------------------------------------------------ decoding
    def _decode(self, rows: list[_Row], params: SamplingParams, want_routes: bool, epoch: int) -> list[str]:
        """Run one chunk to completion in place; returns the weight version behind each decode step's token."""
        from transformers import DynamicCache

        width = max(len(r.prompt) for r in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row.prompt) :] = torch.tensor(row.prompt)
            mask[i, width - len(row.prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        active = list(range(len(rows)))  # row index of each batch row
        cache = DynamicCache(config=self.model.config)
        versions: list[str] = []
        if not self._wait_running(epoch):
            for row in rows:
                row.finish = "abort"
            return versions
        logits, routes = self._forward(ids, mask, positions, cache, want_routes, versions)
        if routes is not None:
            for i, row in enumerate(rows):
                row.routes.extend(routes[i, width - len(row.prompt) :])
        for _ in range(params.max_new_tokens):
            if not self._wait_running(epoch):
                break
            uniforms = None
            if not is_greedy(params):
                gens = [rows[i].generator for i in active]
                uniforms = (
                    torch.stack([torch.rand((), generator=g) for g in gens])
                    if gens[0] is not None
                    else torch.rand(len(active))
                )
            tokens, log_probs = sample_tokens(logits, params, uniforms)
            keep = []
            for b, (i, tok, lp) in enumerate(zip(active, tokens.tolist(), log_probs.tolist(), strict=True)):
                row = rows[i]
                row.response.append(tok)
                row.log_probs.append(lp)
                if tok in params.stop_token_ids or tok in self.eos_token_ids:
                    row.finish = "stop"
                elif len(row.response) >= params.max_new_tokens:
                    row.finish = "length"
                else:
                    keep.append(b)
            self.generated_tokens += len(active)
            if not keep:
                break
            if len(keep) < len(active):
                index = torch.tensor(keep)
                cache.batch_select_indices(index.to(self.device))
                mask, positions, tokens = mask[index], positions[index], tokens[index]
                active = [active[b] for b in keep]
            mask = torch.cat([mask, torch.ones((len(active), 1), dtype=mask.dtype)], dim=1)
            positions = positions[:, -1:] + 1
            logits, routes = self._forward(tokens[:, None], mask, positions, cache, want_routes, versions)
            if routes is not None:
                for b, i in enumerate(active):
                    rows[i].routes.append(routes[b, 0])
        for row in rows:
            if row.finish is None:
                row.finish = "abort" if self._aborted(epoch) else "length"
        return versions

    @torch.inference_mode()
    def _forward(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache,
        want_routes: bool,
        versions: list[str],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Last-position logits ``[B, V]`` and, if asked, routes ``[B, T, moe_layers, top_k]`` of one step."""
        with self._lock:
            self._check_open()
            sink: list[torch.Tensor] = []
            self._route_sink = sink if want_routes else None
            try:
                out = self.model(
                    input_ids=ids.to(self.device),
                    attention_mask=mask.to(self.device),
                    position_ids=positions.to(self.device),
                    cache=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
            finally:
                self._route_sink = None
            versions.append(self._version)
        routes = None
        if want_routes:
            batch, seq = ids.shape
            routes = torch.stack(sink, dim=1).view(batch, seq, len(sink), -1).cpu()
        return out.logits[:, -1].cpu(), routes

    def _record_route(self, indices: torch.Tensor) -> None:
        """One MoE layer's top-k expert ids `[tokens, top_k]`, from the family's route recorder."""
        if self._route_sink is not None:
            self._route_sink.append(indices)

    def _to_sample(self, row: _Row, versions: list[str], group: int, want_routes: bool) -> Sample:
        if row.finish is None:
            raise RuntimeError("a sample was built from a row that has not finished decoding")
        token_versions = versions[: len(row.response)]  # token t was sampled from forward t's logits
        metadata = {}
        if len(set(token_versions)) > 1:
            metadata["weight_versions"] = _spans(token_versions)
        routed = None
        fed = len(row.prompt) + len(row.response) - 1
        if want_routes and len(row.routes) >= fed:  # no routes when aborted before the prompt was run
            routed = torch.stack(row.routes[:fed]).to(self._routes_dtype).numpy()
        return Sample(
            prompt_ids=row.prompt,
            response_ids=row.response,
            response_log_probs=row.log_probs,
            finish_reason=row.finish,
            weight_version=token_versions[-1] if token_versions else self._version,
            group_index=group,
            routed_experts=routed,
            metadata=metadata,
        )

    @functools.cached_property
    def _routes_dtype(self) -> torch.dtype:
        """Expert-id dtype of recorded routes; asked only with routes, so any other model still generates."""
        return routes_dtype(model_dims(self.model.config.to_dict()).num_experts)

    # ------------------------------------------------------------------ control
    def _aborted(self, epoch: int) -> bool:
        return self._abort_epoch != epoch or self._closed

    def _wait_running(self, epoch: int) -> bool:
        """Block while paused; False when the call was aborted."""
        while not self._running.wait(_PAUSE_POLL_S):
            if self._aborted(epoch):
                return False
        return not self._aborted(epoch)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("LocalEngine was shut down")


def _eos_ids(model) -> frozenset[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def _sample_generator(seed: int | None, index: int) -> torch.Generator | None:
    """A random stream per sample, a function of (seed, sample index) only: batching does not change results."""
    if seed is None:
        return None
    seed %= 1 << 64
    state = np.random.SeedSequence([seed & 0xFFFFFFFF, seed >> 32, index]).generate_state(1, np.uint64)
    return torch.Generator().manual_seed(int(state[0] >> 1))


def _spans(versions: list[str]) -> list[tuple[str, int, int]]:
    """Run-length spans ``(version, start, end)`` over token positions, like SGLang's `weight_versions`."""
    spans: list[tuple[str, int, int]] = []
    for t, version in enumerate(versions):
        if spans and spans[-1][0] == version:
            spans[-1] = (version, spans[-1][1], t + 1)
        else:
            spans.append((version, t, t + 1))
    return spans
