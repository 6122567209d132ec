"""The trainer's side of verified weight syncs (`rollout.verify_sync`): which syncs are checked, the actor's
log-probs of the probe, and one verdict for every rank.

The probe and its comparison are `rollout.sync_probe`'s. Collective: every rank calls `after_sync` at every sync
(the actor's scoring pass runs on all of them); rank 0 holds the engine, compares, and broadcasts the verdict, so
a mismatch stops every rank with the same `WeightSyncMismatch`.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from megatron_rl.megatron_backend.actor.batch import TokenBatch
from megatron_rl.megatron_backend.actor.megatron_actor import MegatronActor
from megatron_rl.megatron_backend.distributed import broadcast_object
from megatron_rl.rollout.engine import RolloutEngine, RolloutEngineError
from megatron_rl.rollout.engines.engine_memory import CACHE_TAGS
from megatron_rl.rollout.sync_probe import VerifyMode, WeightSyncMismatch, compare_probe, verify_due


class SyncVerifier:
    """Counts the run's syncs and verifies those `rollout.verify_sync` asks for, and the first partial one (a sync
    whose update failed is verified at the next one that succeeds)."""

    def __init__(self, mode: VerifyMode, every: int, prompts: list[list[int]], *, release_memory: bool = False):
        """`prompts`: the probe (`sync_probe.probe_prompts`); `release_memory`: the engine's caches are released
        during syncs (rollout.release_memory) and are taken back for the probe."""
        self.mode, self.every, self.prompts = mode, every, prompts
        self.release_memory = release_memory
        self.syncs = 0
        self._pending = False
        self._partial_verified = False
        self._metrics: dict[str, float] = {}

    def after_sync(
        self, actor: MegatronActor, engine: RolloutEngine, version: str, *, synced: bool, partial: bool = False
    ) -> None:
        """Collective, right after the sync to `version` (`synced`: rank 0's update succeeded; rank 0 holds the
        engine). `partial`: it sent only what LoRA's adapters change (`rollout_phase.WeightSync`); the run's first
        such sync is verified too, so a tensor that partial syncs leave stale is caught whatever the schedule."""
        index, self.syncs = self.syncs, self.syncs + 1
        first_partial = partial and not self._partial_verified
        if not (self._pending or verify_due(self.mode, self.every, index) or first_partial):
            return
        if not broadcast_object(synced):
            self._pending = True  # the next rollout repairs the engine and re-sends: verify that sync
            return
        start = time.perf_counter()
        expected = probe_log_probs(actor, self.prompts)
        verdict, failure = ("ok", ""), None
        if torch.distributed.get_rank() == 0:
            try:
                mismatch = self._check(engine, expected, version)
                verdict = ("ok", "") if mismatch is None else ("mismatch", mismatch)
            except RolloutEngineError:
                verdict = ("pending", "")  # the engine failed while scoring: recovered and re-sent at the next rollout
            except Exception as err:  # raised on every rank, so none waits for the others forever
                verdict, failure = ("error", f"scoring the weight-sync probe failed on rank 0: {err!r}"), err
        kind, message = broadcast_object(verdict)
        self._pending = kind == "pending"
        self._partial_verified |= partial and kind == "ok"
        if kind == "mismatch":
            raise WeightSyncMismatch(message)
        if kind == "error":
            raise failure if failure is not None else RuntimeError(message)
        self._metrics["time/sync_probe"] = self._metrics.get("time/sync_probe", 0.0) + time.perf_counter() - start

    def pop_metrics(self) -> dict[str, float]:
        """`sync/probe_logp_diff_max`, `sync/probe_logp_diff_mean` and `time/sync_probe` of the syncs verified
        since the last call."""
        metrics, self._metrics = self._metrics, {}
        return metrics

    def _check(self, engine: RolloutEngine, expected: list[list[float]], version: str) -> str | None:
        if self.release_memory:
            engine.resume_memory(list(CACHE_TAGS))
        try:
            served = engine.score_prompts(self.prompts)
        finally:
            if self.release_memory:
                engine.release_memory(list(CACHE_TAGS))
        try:
            results = [compare_probe(expected, replica, version) for replica in served]
        except WeightSyncMismatch as err:
            return str(err)
        for key, value in (("sync/probe_logp_diff_max", max(r.max_abs for r in results)),
                           ("sync/probe_logp_diff_mean", max(r.mean_abs for r in results))):  # fmt: skip
            self._metrics[key] = max(value, self._metrics.get(key, value))  # the worst replica and sync
        return None


def probe_log_probs(actor: MegatronActor, prompts: list[list[int]]) -> list[list[float]]:
    """The actor's teacher-forced log-probs of each prompt's tokens after its first (collective), through the
    same `compute_log_probs` pass that scores the old policy."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, : len(prompt)] = torch.tensor(prompt)
    lengths = torch.tensor([len(p) for p in prompts])
    batch = TokenBatch(input_ids=ids, lengths=lengths, response_start=torch.ones_like(lengths))
    logp = actor.compute_log_probs(batch).log_probs
    return [logp[i, 1 : len(p)].tolist() for i, p in enumerate(prompts)]


def build_verifier(rollout_cfg: Any, data: Any) -> SyncVerifier | None:
    """The run's verifier (None with `rollout.verify_sync=off`); its probe from `data.probe_prompts`."""
    if rollout_cfg.verify_sync == "off":
        return None
    return SyncVerifier(
        rollout_cfg.verify_sync,
        rollout_cfg.verify_sync_every,
        data.probe_prompts(),
        release_memory=rollout_cfg.release_memory,
    )
