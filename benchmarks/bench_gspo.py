"""Benchmark the sequence-level GSPO loss (forward + backward): padded reference vs packed torch vs Triton.

Implementations:
  reference  ``algorithms.policy_loss("gspo", agg="seq-mean-token-mean")`` on the right-padded ``[n, L_max]`` batch
  torch      ``kernels.packed_gspo_loss(impl="torch")``: segment sums on the packed ``[T]`` tokens
  triton     ``kernels.packed_gspo_loss(impl="triton")``: one program per sequence (GPU only here)

Workload: ``--sequences`` responses with lengths uniform in ``[L/8, L]`` (the long tail of RL rollouts), per-token
log-probs fp32, a loss mask dropping ~10% of the tokens. Time is the median of ``--repeats`` runs (CUDA events
on GPU); on GPU the peak extra memory is ``max_memory_allocated`` above what the inputs hold. Achieved bandwidth
counts the packed path's minimum traffic (read log-probs, old log-probs, advantages and mask; write the gradient:
17 bytes per token). Results: printed table plus JSON in benchmarks/results/.
Run from the repository root: ``PYTHONPATH=. python benchmarks/bench_gspo.py [--cpu]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from megatron_rl.algorithms.policy_losses import policy_loss
from megatron_rl.kernels import packed_gspo_loss

RESULTS = Path(__file__).resolve().parent / "results"
BYTES_PER_TOKEN = 4 + 4 + 4 + 1 + 4  # log-prob, old log-prob, per-token advantage, mask in; gradient out


def make_workload(sequences: int, max_len: int, device: torch.device, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, max_len // 8), max_len + 1, (sequences,), generator=gen)
    total = int(lengths.sum())
    old = -3 * torch.rand(total, generator=gen)
    return {
        "lengths": lengths.tolist(),
        "cu": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(device),
        "old": old.to(device),
        "new": (old + 1e-3 * torch.randn(total, generator=gen)).to(device),
        "adv": torch.randn(sequences, generator=gen).repeat_interleave(lengths).to(device),
        "mask": (torch.rand(total, generator=gen) > 0.1).to(device),
    }


def padded(values: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(list(values.split(lengths)), batch_first=True)


def run_once(impl: str, w: dict) -> None:
    if impl == "reference":
        lp = padded(w["new"], w["lengths"]).requires_grad_()
        loss, _ = policy_loss(
            "gspo", lp, padded(w["old"], w["lengths"]), padded(w["adv"], w["lengths"]),
            padded(w["mask"], w["lengths"]), agg="seq-mean-token-mean", clip_low=3e-4, clip_high=4e-4,
        )  # fmt: skip
    else:
        lp = w["new"].detach().requires_grad_()
        loss = packed_gspo_loss(lp, w["old"], w["adv"], w["cu"], w["mask"], impl=impl).loss
    loss.backward()


def measure(impl: str, w: dict, repeats: int, cuda: bool) -> dict:
    run_once(impl, w)  # warm-up (Triton compiles here)
    times = []
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run_once(impl, w)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            run_once(impl, w)
            times.append(time.perf_counter() - t0)
    row = {"impl": impl, "time_ms": statistics.median(times) * 1e3}
    if cuda:
        row["peak_extra_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="run on CPU even when CUDA is available")
    parser.add_argument("--sequences", type=int, nargs="+", default=None, help="batch sizes (sequences)")
    parser.add_argument("--max-len", type=int, default=None, help="longest response (tokens)")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if cuda else "cpu")
    sequences = args.sequences or ([256, 1024] if cuda else [64, 256])
    max_len = args.max_len or (16_384 if cuda else 4096)
    repeats = args.repeats or (20 if cuda else 5)
    impls = ["reference", "torch", "triton"] if cuda else ["reference", "torch"]
    name = torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine()
    rows = []
    for n in sequences:
        w = make_workload(n, max_len, device)
        tokens = int(w["cu"][-1])
        for impl in impls:
            row = {"sequences": n, "tokens": tokens, **measure(impl, w, repeats, cuda)}
            row["achieved_gbps"] = tokens * BYTES_PER_TOKEN / (row["time_ms"] / 1e3) / 1e9
            rows.append(row)
            print(
                f"{n:6d} seqs {tokens:10,d} tokens  {impl:9s} {row['time_ms']:9.2f} ms  "
                f"{row['achieved_gbps']:8.2f} GB/s" + (f"  peak +{row['peak_extra_mib']:.0f} MiB" if cuda else ""),
                flush=True,
            )
        del w
    result = {"mode": "gpu" if cuda else "cpu", "device": name, "max_len": max_len, "rows": rows,
              "date": datetime.date.today().isoformat(), "torch": torch.__version__}  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"bench_gspo_{result['mode']}_{datetime.date.today():%Y%m%d}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
