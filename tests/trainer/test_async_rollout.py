"""Async RL's parts (P15): partial rollouts keep each token's version and log-prob exact across a weight update,
the gate puts updates between requests, staleness is measured and bounded."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_rl.config.sampling import SamplingParams
from megatron_rl.rollout.engines.local_engine import LocalEngine
from megatron_rl.rollout.partial_rollout import merge_continuation, version_spans
from megatron_rl.rollout.sample import Sample
from megatron_rl.tiny_model import make_tiny_qwen3_moe
from megatron_rl.trainer.async_rollout import EngineGate, GatedEngine, ProducedBatch, staleness_metrics
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("async_models")
    return make_tiny_qwen3_moe(root / "v0", seed=0), make_tiny_qwen3_moe(root / "v1", seed=1)


def _weights(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return [(name, p.detach().clone()) for name, p in model.state_dict().items()]


@torch.no_grad()
def _scored(model_dir: Path, tokens: list[int], start: int) -> tuple[np.ndarray, np.ndarray]:
    """Log-probs of tokens[start:] under `model_dir`'s weights, by one forward pass over the whole sequence, and
    the routers' top-k at every fed position ([len(tokens) - 1, layers, top_k])."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    routes: list[torch.Tensor] = []
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(lambda m, i, o: routes.append(o[2]))
    logits = model(input_ids=torch.tensor([tokens[:-1]])).logits[0, start - 1 :].float()
    logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[start:])[:, None])[:, 0].numpy()
    return logp, torch.stack(routes, dim=1).numpy()


def test_partial_rollout_keeps_each_tokens_version_and_log_prob(models: tuple[Path, Path]) -> None:
    """A long generation interrupted by an update to other weights continues under them: every token's engine
    log-prob equals what the weights of its own version give that token when the final sequence is scored, and
    every position's recorded routes are those of the weights that fed it."""
    v0, v1 = models
    engine = LocalEngine(v0, weight_version="step-0", stop_on_eos=False)
    gate = EngineGate(engine)
    gated = GatedEngine(gate, partial=True)
    prompts = [[10, 11, 12], [20, 21]]
    params = SamplingParams(max_new_tokens=120, temperature=1.0, seed=3)  # no stop: runs to the cap
    out: list[list[Sample]] = []
    producer = threading.Thread(
        target=lambda: out.append(gated.generate(prompts, params, n=2, return_routed_experts=True))
    )
    producer.start()
    # Interrupt once every row has ~20 tokens.
    wait_until(lambda: engine.generated_tokens >= 4 * 20, 120, "~20 tokens per row", interval_s=0.002)
    with gate.exclusive(interrupt=True):
        engine.update_weights([_weights(v1)], "step-1")
    producer.join(timeout=120)
    (samples,) = out
    assert gate.interruptions == 1 and len(samples) == 4
    for s in samples:
        assert s.finish_reason == "length" and len(s.response_ids) == 120
        spans = version_spans(s)
        assert [v for v, _, _ in spans] == ["step-0", "step-1"] and s.metadata["continuations"] == 1
        (_, a0, b0), (_, a1, b1) = spans
        assert a0 == 0 and 0 < b0 == a1 < b1 == 120
        start = len(s.prompt_ids)
        logp = np.array(s.response_log_probs)
        (logp0, routes0), (logp1, routes1) = _scored(v0, s.tokens, start), _scored(v1, s.tokens, start)
        np.testing.assert_allclose(logp[:b0], logp0[:b0], atol=1e-5, rtol=0)
        np.testing.assert_allclose(logp[a1:], logp1[a1:], atol=1e-5, rtol=0)
        # R3: position p's routes come from the weights that fed it (and sampled token p + 1).
        switch = start + b0 - 1  # the first position fed under step-1: the last step-0 token
        assert s.routed_experts is not None and s.routed_experts.shape == routes0.shape
        np.testing.assert_array_equal(s.routed_experts[:switch], routes0[:switch])
        np.testing.assert_array_equal(s.routed_experts[switch:], routes1[switch:])


def test_an_update_without_partial_waits_for_the_request_in_flight(models: tuple[Path, Path]) -> None:
    v0, v1 = models
    engine = LocalEngine(v0, weight_version="step-0", stop_on_eos=False)
    gate = EngineGate(engine)
    out: list[list[Sample]] = []
    producer = threading.Thread(
        target=lambda: out.append(GatedEngine(gate, partial=False).generate([[10, 11]], SamplingParams(80, seed=1)))
    )
    producer.start()
    wait_until(lambda: engine.generated_tokens >= 10, 60, "the request's first 10 tokens", interval_s=0.002)
    with gate.exclusive(interrupt=False):
        engine.update_weights([_weights(v1)], "step-1")
    producer.join(timeout=60)
    (s,) = out[0]
    assert s.weight_version == "step-0" and "weight_versions" not in s.metadata and len(s.response_ids) == 80


def test_merge_continuation_joins_tokens_versions_and_routes() -> None:
    old_routes = np.full((3, 2, 2), 7, dtype=np.uint8)  # positions 0-2 fed by the first request
    first = Sample([1, 2], [3, 4], [-0.1, -0.2], "abort", "step-0", 5, old_routes, metadata={"answer": "x"})
    new_routes = np.zeros((5, 2, 2), dtype=np.uint8)  # the continuation re-fed 0-3 and fed 4
    cont = Sample([1, 2, 3, 4], [5, 6], [-0.3, -0.4], "stop", "step-1", routed_experts=new_routes)
    merged = merge_continuation(first, cont)
    assert merged.tokens == [1, 2, 3, 4, 5, 6] and merged.response_log_probs == [-0.1, -0.2, -0.3, -0.4]
    assert (merged.finish_reason, merged.weight_version, merged.group_index) == ("stop", "step-1", 5)
    assert merged.metadata["weight_versions"] == [("step-0", 0, 2), ("step-1", 2, 4)]
    assert merged.metadata["answer"] == "x" and merged.routed_experts is not None
    # Each position keeps the routes of the weights that fed it and sampled the next token.
    assert merged.routed_experts[:, 0, 0].tolist() == [7, 7, 7, 0, 0]
    with pytest.raises(ValueError, match="whole sequence"):
        merge_continuation(first, Sample([1, 2], [5], [-0.3], "stop", "step-1"))


def test_staleness_is_measured_per_oldest_token_and_bounded() -> None:
    fresh = Sample([1], [2, 3], [-1.0, -1.0], "stop", "step-4")
    old = Sample([1], [2, 3], [-1.0, -1.0], "stop", "step-4", metadata={"weight_versions": [("step-3", 0, 1),
                 ("step-4", 1, 2)], "continuations": 1})  # fmt: skip
    metrics = staleness_metrics([fresh, old], step=5, k=1)
    assert metrics == {
        "async/staleness_mean": 0.5,
        "async/staleness_max": 1.0,
        "async/staleness_frac_0": 0.5,
        "async/staleness_frac_1": 0.5,
        "async/partial_share": 0.5,
    }
    with pytest.raises(RuntimeError, match="exceed trainer.max_staleness=1"):
        staleness_metrics([fresh, old], step=6, k=1)


def test_a_produced_batch_round_trips_through_json_exactly() -> None:
    import json

    s = Sample([1, 2], [3], [-0.123456789], "stop", "step-2", 1, np.ones((2, 1, 2), np.uint8), 0.75, {"a": [1]})
    batch = ProducedBatch(3, [s], {"rollout/reward_mean": 0.75}, {"synthetic": {"seed": 1, "train_drawn": 8}})
    back = ProducedBatch.from_json(json.loads(json.dumps(batch.to_json())))
    assert back.step == 3 and back.metrics == batch.metrics and back.data_state == batch.data_state
    (t,) = back.samples
    assert (t.tokens, t.response_log_probs, t.reward, t.metadata) == (s.tokens, s.response_log_probs, 0.75, {"a": [1]})
    assert t.routed_experts is not None and t.routed_experts.dtype == np.uint8
    np.testing.assert_array_equal(t.routed_experts, s.routed_experts)


def test_a_producer_that_fails_unexpectedly_fails_the_trainers_next_take() -> None:
    """Not a dead engine (that is recovered) but a bug in the rollout, e.g. an environment raising: the trainer
    gets the error at its next take instead of waiting forever."""
    from types import SimpleNamespace

    from megatron_rl.trainer.async_rollout import RolloutProducer

    class BrokenData:
        def state_dict(self) -> dict:
            return {}

        def collect(self, engine, step):
            raise ValueError("the environment broke")

    cfg = SimpleNamespace(trainer=SimpleNamespace(max_staleness=1), rollout=SimpleNamespace(partial=False))
    engine = SimpleNamespace(abort=lambda: None)
    producer = RolloutProducer(cfg, engine, BrokenData(), next_step=1, last_step=3, version=0)
    try:
        with pytest.raises(RuntimeError, match="step 1: the rollout producer failed: ValueError") as caught:
            producer.take(1)
        assert isinstance(caught.value.__cause__, ValueError)
    finally:
        producer.shutdown()


def test_a_trainer_waiting_to_sync_wakes_when_the_batch_fails() -> None:
    """The engine dies while the trainer already waits to send the next weights (`updating`): the failed batch
    must wake it (it then finds the engine dead and repairs it), not leave both threads waiting for each other."""
    import threading
    from types import SimpleNamespace

    from megatron_rl.rollout.engine import RolloutEngineError
    from megatron_rl.trainer.async_rollout import RolloutProducer
    from tests.waiting import wait_until

    release = threading.Event()

    class DyingEngineData:
        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state: dict) -> None:
            pass

        def collect(self, engine, step):
            release.wait()
            raise RolloutEngineError("the engine process died")

    cfg = SimpleNamespace(trainer=SimpleNamespace(max_staleness=1), rollout=SimpleNamespace(partial=False))
    producer = RolloutProducer(cfg, SimpleNamespace(abort=lambda: None), DyingEngineData(), next_step=1, last_step=3,
                               version=0)  # fmt: skip
    entered = threading.Event()

    def sync_weights() -> None:
        with producer.updating(0):  # waits for batch 1 (version 0 + k = 1) to be generated
            entered.set()

    trainer = threading.Thread(target=sync_weights, daemon=True)
    try:
        trainer.start()
        wait_until(lambda: len(producer._cond._waiters) == 1, 10, "the trainer waiting in updating()")
        release.set()  # batch 1 fails now, with the trainer already waiting
        assert entered.wait(timeout=30), "the trainer was not woken by the failed batch"
    finally:
        release.set()
        producer.shutdown()
        trainer.join(timeout=30)
