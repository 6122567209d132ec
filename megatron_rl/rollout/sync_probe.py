"""Verified weight syncs: after a sync the engine scores a fixed probe, and its log-probs must be the trainer's.

The probe is a few hundred tokens of the run's own prompts, scored prefill-only (teacher-forced, temperature 1)
by every replica of the engine (`RolloutEngine.score_prompts`) and by the trainer's actor under the weights just
sent. Each replica must also report the version that was sent. The tolerance is per dtype of the engine's
compute, measured on healthy syncs (docs/reliability.md, "Verified weight syncs"): any replica beyond it stops
the run with `WeightSyncMismatch`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from megatron_rl.rollout.engine import ServedScores

VerifyMode = Literal["off", "first", "every"]
PROBE_TOKENS = 256  # tokens of real prompts per probe


@dataclass(frozen=True)
class ProbeTolerance:
    """The largest |served - trainer| log-prob error a healthy sync may show over the probe: on any token
    (`max_abs`) and on average (`mean_abs`)."""

    max_abs: float
    mean_abs: float


# Healthy worst cases measured against an fp32 trainer (docs/reliability.md, "Verified weight syncs", with the
# commands): fp32 local engine 4.8e-6 max / 7.4e-7 mean, fp32 SGLang 2.4e-6 / 5.1e-7 (>= 200x margin: GPU fp32
# kernels are unmeasured); bf16 SGLang 0.46 / 0.012 (about 4x; the max varied 0.03-0.46 between syncs, so bf16 is
# judged mainly by the mean). One layer-0 expert scaled by 1.5 measured 1.93 / 0.155. float16 takes bf16's, unmeasured.
TOLERANCES: dict[str, ProbeTolerance] = {
    "float32": ProbeTolerance(max_abs=1e-3, mean_abs=1e-4),
    "bfloat16": ProbeTolerance(max_abs=2.0, mean_abs=0.05),
    "float16": ProbeTolerance(max_abs=2.0, mean_abs=0.05),
}
LIKELY_CAUSES = (
    "an engine kernel that re-lays out or re-quantises MoE expert weights after loading, a parameter the sync "
    "missed (a name the engine does not map, a draft/MTP module), or a wrong TP/EP merge of a sharded parameter"
)


class WeightSyncMismatch(RuntimeError):
    """The engine does not compute with the weights the trainer sent."""

    stops_run = True  # the CLI prints the message alone, no traceback


@dataclass(frozen=True)
class ProbeResult:
    replica: str
    max_abs: float
    mean_abs: float
    tokens: int


def tolerance_for(dtype: str) -> ProbeTolerance:
    """The tolerance of an engine computing in `dtype`; the loosest (bfloat16) for an unknown one."""
    return TOLERANCES.get(dtype.removeprefix("torch."), TOLERANCES["bfloat16"])


def verify_due(mode: VerifyMode, every: int, sync_index: int) -> bool:
    """Whether sync number `sync_index` (0 = the run's first) is verified: never, the first only, or the first
    and every `every`-th after it."""
    if mode == "off":
        return False
    if mode == "first":
        return sync_index == 0
    return sync_index % every == 0


def probe_prompts(prompts: Iterable[list[int]], tokens: int = PROBE_TOKENS) -> list[list[int]]:
    """Whole prompts (>= 2 tokens each) in order until they hold `tokens` tokens, the last one cut to fit."""
    out: list[list[int]] = []
    total = 0
    for prompt in prompts:
        if len(prompt) < 2:
            continue
        take = list(prompt[: tokens - total])
        if len(take) >= 2:
            out.append(take)
            total += len(take)
        if total >= tokens:
            break
    if not out:
        raise ValueError("no prompt of two or more tokens to build the weight-sync probe from")
    return out


def compare_probe(
    expected: list[list[float]], served: ServedScores, version: str, tolerance: ProbeTolerance | None = None
) -> ProbeResult:
    """|served - expected| over the probe; raises `WeightSyncMismatch` when the replica reports another version
    than `version` or the error exceeds `tolerance` (default: `tolerance_for(served.dtype)`)."""
    tol = tolerance or tolerance_for(served.dtype)
    if served.version != version:
        raise WeightSyncMismatch(
            f"weight sync to version {version!r}: {served.replica} reports version {served.version!r} after the "
            f"sync (the update did not reach it, or it was restarted since); likely causes: {LIKELY_CAUSES}"
        )
    if [len(r) for r in served.log_probs] != [len(r) for r in expected]:
        raise WeightSyncMismatch(
            f"weight sync to version {version!r}: {served.replica} scored {sum(map(len, served.log_probs))} probe "
            f"tokens, the trainer {sum(map(len, expected))}"
        )
    pairs = zip(served.log_probs, expected, strict=True)
    diffs = [abs(a - b) for got, want in pairs for a, b in zip(got, want, strict=True)]
    result = ProbeResult(served.replica, max(diffs), sum(diffs) / len(diffs), len(diffs))
    if not (result.max_abs <= tol.max_abs and result.mean_abs <= tol.mean_abs):  # NaN fails too
        raise WeightSyncMismatch(
            f"weight sync to version {version!r} did not take effect on {served.replica}: on a probe of "
            f"{result.tokens} scored prompt tokens its log-probs differ from the trainer's by max |dlogp| = "
            f"{result.max_abs:.4g}, mean {result.mean_abs:.4g} (tolerance for {served.dtype}: max "
            f"{tol.max_abs:g}, mean {tol.mean_abs:g}); likely causes: {LIKELY_CAUSES}. The run stops: generating "
            "with other weights than the trained ones corrupts every later step (rollout.verify_sync=off skips "
            "this check)"
        )
    return result
