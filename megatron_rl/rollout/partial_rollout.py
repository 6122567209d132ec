"""Partial rollouts: a generation interrupted by a weight update continues under the new weights.

Kimi k1.5 (arXiv 2501.12599 §2.6.2) and slime's ``--partial-rollout``: instead of throwing away the requests in
flight when new weights arrive, abort them, load the weights, and send each unfinished sequence again as the prompt
of its continuation. The continuation's prefill recomputes the whole prefix with the new weights, so every token
keeps the log-prob and the weight version of exactly the weights that sampled it: the behaviour log-probs the
off-policy correction needs are exact per token (`metadata["weight_versions"]` spans say which tokens came from
which version, as the engines report them).

`generate_continuing(engine, ..., interrupted)` is one `engine.generate` call that hides the interruptions: the
samples an update aborted (`interrupted()` says an update happened during the call) are continued until they end
on their own; samples aborted for another reason stay aborted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import numpy as np

from megatron_rl.config.sampling import SamplingParams
from megatron_rl.rollout.sample import Sample

CONTINUATION_SEED_STRIDE = 7919  # continuation c of a call samples with seed + c * stride (a fresh stream)


class Generates(Protocol):
    """What is needed of the engine: `RolloutEngine.generate`."""

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, n: int = 1, return_routed_experts: bool = False
    ) -> list[Sample]: ...


def generate_continuing(
    engine: Generates,
    prompts: list[list[int]],
    params: SamplingParams,
    n: int,
    return_routed_experts: bool,
    interrupted: Callable[[], int],
) -> list[Sample]:
    """`engine.generate(prompts, params, n=n)`, with the samples that weight updates aborted continued under the
    new weights. `interrupted()` counts the updates that aborted requests so far (the caller increments it before
    aborting the engine for an update)."""
    before = interrupted()
    samples = engine.generate(prompts, params, n=n, return_routed_experts=return_routed_experts)
    continuation = 0
    while interrupted() != before:
        todo = [i for i, s in enumerate(samples) if s.finish_reason == "abort"]
        if not todo:
            break
        before = interrupted()
        continuation += 1
        # Rows aborted at the same step have the same budget left: one call per budget.
        by_budget: dict[int, list[int]] = {}
        for i in todo:
            by_budget.setdefault(params.max_new_tokens - len(samples[i].response_ids), []).append(i)
        for budget, rows in by_budget.items():
            if budget <= 0:
                for i in rows:
                    samples[i] = replace(samples[i], finish_reason="length")
                continue
            seed = None if params.seed is None else params.seed + continuation * CONTINUATION_SEED_STRIDE
            more = engine.generate(
                [samples[i].tokens for i in rows],
                replace(params, max_new_tokens=budget, seed=seed),
                n=1,
                return_routed_experts=return_routed_experts,
            )
            for i, cont in zip(rows, more, strict=True):
                samples[i] = merge_continuation(samples[i], cont)
    return samples


def merge_continuation(first: Sample, cont: Sample) -> Sample:
    """`first` (aborted) followed by `cont`, generated from `first.tokens`: one sample of `first`'s prompt whose
    tokens keep their own log-probs and versions. Routes (R3) too: the positions `first`'s request fed keep its
    routes (the old weights' choices, which sampled the tokens after them); the continuation's prefill re-ran them
    with the new weights, and only its routes from `first`'s last token on are taken."""
    if cont.prompt_ids != first.tokens:
        raise ValueError("a continuation must be generated from the interrupted sample's whole sequence")
    offset = len(first.response_ids)
    spans = version_spans(first) + [(v, a + offset, b + offset) for v, a, b in version_spans(cont)]
    merged_spans: list[tuple[str, int, int]] = []
    for version, start, end in spans:
        if start == end:
            continue
        if merged_spans and merged_spans[-1][0] == version and merged_spans[-1][2] == start:
            merged_spans[-1] = (version, merged_spans[-1][1], end)
        else:
            merged_spans.append((version, start, end))
    metadata = {**first.metadata, **cont.metadata}
    metadata.pop("weight_versions", None)
    if len({v for v, _, _ in merged_spans}) > 1:
        metadata["weight_versions"] = merged_spans
    metadata["continuations"] = first.metadata.get("continuations", 0) + 1
    return Sample(
        prompt_ids=first.prompt_ids,
        response_ids=first.response_ids + cont.response_ids,
        response_log_probs=first.response_log_probs + cont.response_log_probs,
        finish_reason=cont.finish_reason,
        weight_version=cont.weight_version,
        group_index=first.group_index,
        routed_experts=_joined_routes(first, cont),
        metadata=metadata,
    )


def _joined_routes(first: Sample, cont: Sample):
    if first.routed_experts is None or cont.routed_experts is None:  # aborted before the prompt ran: all new
        return cont.routed_experts
    fed = len(first.tokens) - 1  # `first`'s last token was sampled, never fed
    return np.concatenate([first.routed_experts[:fed], cont.routed_experts[fed:]])


def version_spans(sample: Sample) -> list[tuple[str, int, int]]:
    """`(version, start, end)` spans over the response positions: the engine's, else one span of the sample's
    version."""
    spans = sample.metadata.get("weight_versions")
    if spans:
        return [(str(v), int(a), int(b)) for v, a, b in spans]
    return [(sample.weight_version, 0, len(sample.response_ids))]
