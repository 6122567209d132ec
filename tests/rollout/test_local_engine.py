"""LocalEngine against transformers itself: greedy parity with `generate`, teacher-forced log-probs and routes,
stop handling, grouping, seeding, weight updates and control (abort, pause, shutdown)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from megatron_rl.config.sampling import SamplingParams
from megatron_rl.models.architecture import model_dims
from megatron_rl.rollout.engines.hf_weight_loading import WeightUpdateError
from megatron_rl.rollout.engines.local_engine import LocalEngine
from megatron_rl.tiny_model import make_tiny_qwen3_moe

PROMPTS = [[10, 11, 12, 13, 14, 15, 16], [20, 21], [30, 31, 32, 33]]  # different lengths: left padding is exercised


@pytest.fixture(scope="module")
def hf_model(tiny_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_dir).eval()


@torch.no_grad()
def teacher_forced(model, prompt: list[int], response: list[int], temperature: float = 1.0):
    """Log-probs of `response` under softmax(logits / temperature) and the routes of every fed position."""
    routes: list[torch.Tensor] = []
    routers = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    hooks = [r.register_forward_hook(lambda m, i, o: routes.append(o[2])) for r in routers]
    try:
        tokens = torch.tensor([prompt + response])
        logits = model(input_ids=tokens[:, :-1]).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    log_probs = torch.log_softmax(logits[len(prompt) - 1 :] / temperature, dim=-1)
    chosen = log_probs.gather(-1, torch.tensor(response)[:, None])
    ranks = (log_probs > chosen).sum(-1)  # 0 = the most likely token
    return chosen[:, 0], ranks, torch.stack(routes, dim=1).numpy()  # routes: [positions, moe_layers, top_k]


def test_greedy_matches_hf_generate(engine: LocalEngine, hf_model):
    samples = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.0))
    for prompt, sample in zip(PROMPTS, samples, strict=True):
        ref = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, pad_token_id=3)
        assert sample.response_ids == ref[0, len(prompt) :].tolist()
        assert sample.finish_reason == "length"
        assert sample.weight_version == "default"
        # greedy reports log softmax(logits) (temperature 1, as SGLang)
        expected, ranks, _ = teacher_forced(hf_model, prompt, sample.response_ids)
        assert ranks.max() == 0
        np.testing.assert_allclose(sample.response_log_probs, expected.numpy(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, -1), (0.7, 0.8, 20)])
def test_sampled_log_probs_match_teacher_forcing(engine: LocalEngine, hf_model, temperature, top_p, top_k):
    """Log-probs are of softmax(logits / T), untruncated by top-p/top-k, across chunks (max_batch_size 4)."""
    engine.max_batch_size = 4
    try:
        params = SamplingParams(max_new_tokens=16, temperature=temperature, top_p=top_p, top_k=top_k, seed=3)
        samples = engine.generate(PROMPTS, params, n=3)
    finally:
        engine.max_batch_size = 64
    assert len(samples) == 9
    for sample in samples:
        expected, ranks, _ = teacher_forced(hf_model, sample.prompt_ids, sample.response_ids, temperature)
        np.testing.assert_allclose(sample.response_log_probs, expected.numpy(), atol=1e-5, rtol=0)
        if top_k > 0:  # every sampled token is inside the top-k of its step
            assert ranks.max() < top_k


def test_routed_experts_match_teacher_forcing(tiny_moe_dir: Path):
    """On a 4-layer model with a dense layer 1: routes of 3 MoE layers for every fed position, uint8."""
    engine = LocalEngine(tiny_moe_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir).eval()
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=0, stop_token_ids=(40, 41, 42))
    samples = engine.generate(PROMPTS, params, n=2, return_routed_experts=True)
    for sample in samples:
        _, _, routes = teacher_forced(model, sample.prompt_ids, sample.response_ids)
        fed = len(sample.prompt_ids) + len(sample.response_ids) - 1
        assert sample.routed_experts.shape == (fed, 3, 2) and sample.routed_experts.dtype == np.uint8
        np.testing.assert_array_equal(sample.routed_experts, routes)


@torch.no_grad()
def test_routed_experts_are_the_families_moe_layers_in_order(tiny_moe_dir: Path):
    """Column j of the routes is MoE layer `model_dims(config).moe_layers[j]`'s top-k (the layout SGLang's columns
    are reduced to), checked against each layer's own router, looked up by layer index."""
    engine = LocalEngine(tiny_moe_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir).eval()
    moe_layers = model_dims(model.config.to_dict()).moe_layers
    dense = [i for i in range(model.config.num_hidden_layers) if i not in moe_layers]
    assert dense == [1] and not hasattr(model.model.layers[1].mlp, "gate")  # a dense layer between MoE layers
    sample = engine.generate(
        [PROMPTS[0]], SamplingParams(max_new_tokens=6, temperature=1.0, seed=1), return_routed_experts=True
    )[0]
    per_layer: dict[int, torch.Tensor] = {}
    hooks = [
        model.model.layers[i].mlp.gate.register_forward_hook(lambda m, a, o, i=i: per_layer.__setitem__(i, o[2]))
        for i in moe_layers
    ]
    try:
        model(input_ids=torch.tensor([sample.prompt_ids + sample.response_ids[:-1]]))
    finally:
        for hook in hooks:
            hook.remove()
    assert sample.routed_experts.shape == (len(sample.prompt_ids) + len(sample.response_ids) - 1, len(moe_layers), 2)
    for column, layer in enumerate(moe_layers):
        np.testing.assert_array_equal(sample.routed_experts[:, column], per_layer[layer].numpy())


def test_stop_token_is_kept_and_ends_the_response(engine: LocalEngine):
    free = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=0.0))
    stop = free[0].response_ids[3]
    first = free[0].response_ids.index(stop)
    stopped = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=(stop,)))
    assert stopped[0].finish_reason == "stop"
    assert stopped[0].response_ids == free[0].response_ids[: first + 1]  # stop token included
    assert stopped[0].response_log_probs == pytest.approx(free[0].response_log_probs[: first + 1], abs=1e-6)
    for a, b in zip(free[1:], stopped[1:], strict=True):  # the other rows are unaffected by the one that stopped
        ends = [t + 1 for t, tok in enumerate(a.response_ids) if tok in (stop, 2)]
        assert b.response_ids == a.response_ids[: ends[0] if ends else 16]
        assert b.finish_reason == ("stop" if ends else "length")
    assert engine.eos_token_ids == frozenset({2})  # <|im_end|> also stops (SGLang's ignore_eos=false)


def test_groups_are_prompt_major_and_seeded_runs_reproduce(engine: LocalEngine):
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=123)
    samples = engine.generate(PROMPTS, params, n=3)
    assert [s.group_index for s in samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [s.prompt_ids for s in samples] == [p for p in PROMPTS for _ in range(3)]
    assert len({tuple(s.response_ids) for s in samples[:3]}) == 3  # the group's samples differ
    again = engine.generate(PROMPTS, params, n=3)
    assert [s.response_ids for s in again] == [s.response_ids for s in samples]
    # a sample's random stream depends on (seed, sample index) only, not on batching
    engine.max_batch_size = 2
    try:
        chunked = engine.generate(PROMPTS, params, n=3)
    finally:
        engine.max_batch_size = 64
    assert [s.response_ids for s in chunked] == [s.response_ids for s in samples]
    other = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=1.0, seed=124), n=3)
    assert [s.response_ids for s in other] != [s.response_ids for s in samples]


def test_update_weights_loads_checkpoint_names_strictly(tiny_dir: Path, tmp_path: Path):
    """Checkpoint (per-expert) names fill the fused expert tensors; bad names or shapes raise."""
    other = LocalEngine(make_tiny_qwen3_moe(tmp_path / "other", seed=1))
    reference = LocalEngine(tiny_dir)
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    before = other.generate(PROMPTS, params)
    ref = reference.generate(PROMPTS, params)
    assert [s.response_ids for s in before] != [s.response_ids for s in ref]
    tensors = sorted(load_file(tiny_dir / "model.safetensors").items())
    assert any(".mlp.experts.3.up_proj.weight" in name for name, _ in tensors)
    other.update_weights([tensors[:10], tensors[10:]], version="v1")
    after = other.generate(PROMPTS, params)
    assert [s.response_ids for s in after] == [s.response_ids for s in ref]
    assert [s.response_log_probs for s in after] == [s.response_log_probs for s in ref]
    assert {s.weight_version for s in after} == {"v1"} and other.healthy()

    perturbed = [(n, t + 0.5 * torch.randn_like(t)) if "mlp.experts" in n else (n, t) for n, t in tensors]
    other.update_weights([perturbed], version="v2")
    changed = other.generate(PROMPTS, params)
    assert [s.response_ids for s in changed] != [s.response_ids for s in ref]

    with pytest.raises(WeightUpdateError, match="unknown weight 'model.layers.0.mlp.bogus.weight'"):
        other.update_weights([[("model.layers.0.mlp.bogus.weight", torch.zeros(2))]], version="v3")
    with pytest.raises(WeightUpdateError, match=r"experts.9.gate_proj.weight"):  # expert index out of range
        other.update_weights([[("model.layers.0.mlp.experts.9.gate_proj.weight", torch.zeros(32, 64))]], "v3")
    name, tensor = tensors[0]
    with pytest.raises(WeightUpdateError, match=r"shape \(128, 63\).*expects \(128, 64\)"):
        other.update_weights([[(name, tensor[:, :63])]], version="v3")
    assert other.weight_version == "v2" and other.healthy()  # a rejected first bucket changes nothing
    with pytest.raises(WeightUpdateError):
        other.update_weights([tensors[:5], [(name, tensor[:, :63])]], version="v3")
    assert not other.healthy() and other.weight_version == "v2"  # half-loaded: visible


class _StepGate:
    """Instruments a real engine's decode loop: the generating thread stops after its `after`-th forward step
    until the test has acted (`act()` is called there, as if from another thread while that step was in flight),
    and every wait of a paused generation is counted, so a test synchronises on events, not on sleeps."""

    def __init__(self, engine: LocalEngine, monkeypatch: pytest.MonkeyPatch, after: int):
        self.engine, self.after, self.forwards = engine, after, 0
        self.reached, self.acted = threading.Event(), threading.Event()
        self.paused_waits = threading.Semaphore(0)
        forward, running = engine._forward, engine._running

        def gated_forward(*args, **kwargs):
            out = forward(*args, **kwargs)
            self.forwards += 1
            if self.forwards == self.after:
                self.reached.set()
                assert self.acted.wait(60), "the test did not act"
            return out

        paused_waits = self.paused_waits

        class CountingEvent(threading.Event):
            def wait(self, timeout=None) -> bool:
                answer = super().wait(timeout)
                if not answer:  # a paused generation's poll
                    paused_waits.release()
                return answer

        counting = CountingEvent()
        if running.is_set():
            counting.set()
        monkeypatch.setattr(engine, "_forward", gated_forward)
        monkeypatch.setattr(engine, "_running", counting)

    def act(self, action) -> None:
        """Run `action` once the generating thread holds its `after`-th step, then let it go on."""
        assert self.reached.wait(60), "generation never reached the step"
        action()
        self.acted.set()


def test_abort_from_another_thread(engine: LocalEngine, monkeypatch: pytest.MonkeyPatch):
    params = SamplingParams(max_new_tokens=400, temperature=1.0, seed=0)
    result: list = []
    gate = _StepGate(engine, monkeypatch, after=3)  # prefill + 2 decode steps: 2 tokens per sample
    thread = threading.Thread(target=lambda: result.extend(engine.generate(PROMPTS, params, n=2)))
    thread.start()
    gate.act(engine.abort)
    thread.join(timeout=30)
    assert not thread.is_alive() and len(result) == 6
    for sample in result:
        assert sample.finish_reason == "abort"
        assert 0 < len(sample.response_ids) < 400 and len(sample.response_log_probs) == len(sample.response_ids)
    # an abort ends only the calls in progress
    after = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=0.0))
    assert [s.finish_reason for s in after] == ["length"] * 3


def test_pause_holds_generation_and_weights_change_between_steps(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch):
    engine = LocalEngine(tiny_dir)
    params = SamplingParams(max_new_tokens=300, temperature=1.0, seed=0)
    result: list = []
    gate = _StepGate(engine, monkeypatch, after=6)  # paused while the 6th forward step is in flight
    thread = threading.Thread(target=lambda: result.extend(engine.generate(PROMPTS[:1], params)))
    thread.start()
    gate.act(engine.pause)
    assert gate.paused_waits.acquire(timeout=60)  # the step in flight finished, then generation waits
    held = engine.generated_tokens
    for _ in range(3):  # three more waits while paused: no token in between
        assert gate.paused_waits.acquire(timeout=60)
    assert engine.generated_tokens == held == 5 and thread.is_alive()
    state = [(n, p.detach().clone()) for n, p in engine.model.named_parameters()]
    engine.update_weights([state], version="v2")  # same values, new version
    engine.resume()
    thread.join(timeout=30)
    (sample,) = result
    assert sample.finish_reason == "length" and sample.weight_version == "v2"
    (v1, s1, e1), (v2, s2, e2) = sample.metadata["weight_versions"]
    assert (v1, s1, v2, e2) == ("default", 0, "v2", 300) and e1 == s2 == held + 1


def test_shutdown(tiny_dir: Path):
    engine = LocalEngine(tiny_dir)
    assert engine.healthy()
    engine.shutdown()
    assert not engine.healthy()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))


def test_rejects_bad_requests(engine: LocalEngine):
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(PROMPTS, SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="n must be"):
        engine.generate(PROMPTS, SamplingParams(), n=0)


def test_score_prompts_is_teacher_forcing_of_each_prompt_at_its_version(engine: LocalEngine, hf_model):
    (served,) = engine.score_prompts(PROMPTS)  # right-padded together, scored in one pass
    assert (served.replica, served.version, served.dtype) == ("local engine", engine.weight_version, "float32")
    for prompt, got in zip(PROMPTS, served.log_probs, strict=True):
        expected, _, _ = teacher_forced(hf_model, prompt[:1], prompt[1:])
        np.testing.assert_allclose(got, expected.numpy(), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="at least two tokens"):
        engine.score_prompts([[5]])
