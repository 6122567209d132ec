"""Benchmark token log-prob + entropy implementations: time, peak memory, achieved bandwidth.

Implementations (forward + backward of ``sum(w_lp * logp + w_H * H)``):
  naive    fp32 ``log_softmax`` + ``gather`` + entropy with autograd (materialises several [N, V] fp32 tensors)
  chunked  ``megatron_rl.kernels`` impl="chunked" (torch, [chunk, V] fp32 work buffers)
  triton   ``megatron_rl.kernels`` impl="triton" (fused kernels; GPU only here)
  te       ``transformer_engine.pytorch.parallel_cross_entropy`` (log-prob only, no entropy) when importable

GPU mode (default when CUDA is available): N in {16k, 32k, 64k} tokens x V = 151,936, bf16 logits. Time is the
median of CUDA-event timings; peak memory is ``torch.cuda.max_memory_allocated`` minus the memory held before
the call (logits and weights), i.e. the extra memory the implementation needs including its gradient output.
Achieved bandwidth counts the minimum traffic of a fused fwd+bwd: read logits twice, write the gradient once
(3 x N x V x 2 bytes in bf16), compared with the HBM peak of the device (``--hbm-gbps``, known GPUs built in).

CPU mode (``--cpu``, or no CUDA): fp32, a small number of rows. Each implementation runs in a fresh process
that builds its inputs in place, reads its peak RSS (``getrusage().ru_maxrss``), runs one fwd+bwd and reads it
again: the growth is the peak extra memory of the call (glibc serves these large blocks with mmap and returns
them on free, so RSS follows torch's CPU allocations closely; tracemalloc does not see torch's allocator).
Reports the ratio chunked / naive. Results: printed table plus JSON in benchmarks/results/.
Run from the repository root: ``PYTHONPATH=. python benchmarks/bench_logprob.py --cpu``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from megatron_rl.kernels import token_logprobs_and_entropy

RESULTS = Path(__file__).resolve().parent / "results"
HBM_GBPS = {"H100": 3350.0, "H200": 4800.0, "A100": 2039.0, "B200": 8000.0, "GH200": 4000.0}


def naive(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    log_p = torch.log_softmax(logits.float(), dim=-1)
    logprobs = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return logprobs, entropy


def kernel(impl: str) -> Callable:
    return lambda logits, targets: token_logprobs_and_entropy(logits, targets, impl=impl)


def te_cross_entropy() -> Callable | None:
    try:  # a broken TE install raises RuntimeError/OSError, not ImportError
        from transformer_engine.pytorch import parallel_cross_entropy
    except Exception:
        return None

    def run(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, None]:
        return -parallel_cross_entropy(logits.unsqueeze(0), targets.unsqueeze(0), 0.0, False, None)[0], None

    return run


def fwd_bwd(fn: Callable, logits: torch.Tensor, targets: torch.Tensor, w_lp: torch.Tensor, w_h: torch.Tensor) -> None:
    x = logits.detach().requires_grad_()
    logprobs, entropy = fn(x, targets)
    loss = (w_lp * logprobs).sum() + ((w_h * entropy).sum() if entropy is not None else 0.0)
    loss.backward()


def _measure_cpu_one(impl: str, rows: int, vocab: int, repeats: int) -> dict:
    """Run in a fresh process: peak-RSS growth (``ru_maxrss``) of one fwd+bwd, then the median time."""
    import resource

    torch.set_num_threads(max(1, torch.get_num_threads()))
    gen = torch.Generator().manual_seed(0)
    logits = torch.empty(rows, vocab)
    torch.randn(rows, vocab, generator=gen, out=logits).mul_(3)  # in place: no temporary raises the baseline peak
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    w_lp, w_h = torch.randn(rows, generator=gen), torch.randn(rows, generator=gen)
    fn = naive if impl == "naive" else kernel(impl)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    fwd_bwd(fn, logits, targets, w_lp, w_h)
    peak_extra = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fwd_bwd(fn, logits, targets, w_lp, w_h)
        times.append(time.perf_counter() - start)
    return {"time_s": statistics.median(times), "peak_extra_bytes": peak_extra}


def bench_cpu(rows: int, vocab: int, repeats: int) -> dict:
    import subprocess

    results = {}
    for impl in ("naive", "chunked"):
        cmd = [sys.executable, __file__, "--measure-one", impl, "--rows", str(rows), "--vocab", str(vocab),
               "--repeats", str(repeats)]  # fmt: skip
        proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
        results[impl] = json.loads(proc.stdout.strip().splitlines()[-1])
    logits_bytes = rows * vocab * 4
    for entry in results.values():
        entry["peak_extra_over_logits"] = entry["peak_extra_bytes"] / logits_bytes
    return {
        "mode": "cpu",
        "rows": rows,
        "vocab": vocab,
        "dtype": "float32",
        "logits_bytes": logits_bytes,
        "results": results,
        "peak_memory_ratio_chunked_vs_naive": results["chunked"]["peak_extra_bytes"]
        / results["naive"]["peak_extra_bytes"],
        "memory_method": "fresh process per impl; growth of peak RSS (getrusage ru_maxrss) over one fwd+bwd, "
        "measured after the inputs were built in place; includes the gradient output (1x logits)",
    }


def bench_gpu(token_counts: list[int], vocab: int, repeats: int, hbm_gbps: float | None) -> dict:
    device = torch.device("cuda")
    name = torch.cuda.get_device_name()
    if hbm_gbps is None:
        hbm_gbps = next((bw for key, bw in HBM_GBPS.items() if key in name), None)
    impls: dict[str, Callable | None] = {"naive": naive, "chunked": kernel("chunked"), "triton": kernel("triton"),
                                         "te": te_cross_entropy()}  # fmt: skip
    rows_out = []
    for n in token_counts:
        logits = (3 * torch.randn(n, vocab, device=device)).bfloat16()
        targets = torch.randint(0, vocab, (n,), device=device)
        w_lp, w_h = torch.randn(n, device=device), torch.randn(n, device=device)
        min_bytes = 3 * n * vocab * logits.element_size()
        for impl, fn in impls.items():
            row = {"tokens": n, "vocab": vocab, "impl": impl}
            if fn is None:
                rows_out.append({**row, "status": "not installed"})
                continue
            try:
                fwd_bwd(fn, logits, targets, w_lp, w_h)  # warm-up / compile
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                times = []
                for _ in range(repeats):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    fwd_bwd(fn, logits, targets, w_lp, w_h)
                    end.record()
                    torch.cuda.synchronize()
                    times.append(start.elapsed_time(end) / 1e3)
                t = statistics.median(times)
                peak = (torch.cuda.max_memory_allocated() - base) / 2**30
                row.update(status="ok", time_ms=t * 1e3, peak_extra_gib=peak, achieved_gbps=min_bytes / t / 1e9)
                if hbm_gbps:
                    row["fraction_of_hbm"] = row["achieved_gbps"] / hbm_gbps
            except torch.OutOfMemoryError:
                row["status"] = "OOM"
            torch.cuda.empty_cache()
            rows_out.append(row)
        del logits
    return {"mode": "gpu", "device": name, "hbm_gbps": hbm_gbps, "dtype": "bfloat16", "rows": rows_out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="small CPU run (memory ratio chunked vs naive)")
    parser.add_argument("--rows", type=int, default=1024, help="CPU mode: tokens")
    parser.add_argument("--vocab", type=int, default=151936, help="vocabulary size")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768, 65536], help="GPU mode: tokens")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions (median reported)")
    parser.add_argument("--hbm-gbps", type=float, default=None, help="HBM peak GB/s (default: by device name)")
    parser.add_argument("--out", type=Path, default=None, help="JSON output path")
    parser.add_argument("--measure-one", default=None, help=argparse.SUPPRESS)  # internal: CPU child process
    args = parser.parse_args()
    if args.measure_one:
        print(json.dumps(_measure_cpu_one(args.measure_one, args.rows, args.vocab, args.repeats)))
        return

    if args.cpu or not torch.cuda.is_available():
        result = bench_cpu(args.rows, args.vocab, args.repeats)
        print(f"CPU, {args.rows} x {args.vocab} fp32, logits {result['logits_bytes'] / 2**20:.0f} MiB")
        print(f"{'impl':8s} {'time s':>8s} {'peak extra MiB':>15s} {'x logits':>9s}")
        for impl, r in result["results"].items():
            print(
                f"{impl:8s} {r['time_s']:8.3f} {r['peak_extra_bytes'] / 2**20:15.1f} {r['peak_extra_over_logits']:9.2f}"
            )
        print(f"peak memory ratio chunked / naive: {result['peak_memory_ratio_chunked_vs_naive']:.3f}")
    else:
        result = bench_gpu(args.tokens, args.vocab, args.repeats, args.hbm_gbps)
        print(f"{result['device']}, bf16, V={args.vocab}, HBM {result['hbm_gbps']} GB/s")
        print(f"{'tokens':>7s} {'impl':8s} {'ms':>9s} {'peak GiB':>9s} {'GB/s':>8s} {'% HBM':>6s}")
        for r in result["rows"]:
            if r["status"] != "ok":
                print(f"{r['tokens']:7d} {r['impl']:8s} {r['status']}")
                continue
            pct = f"{100 * r['fraction_of_hbm']:6.1f}" if "fraction_of_hbm" in r else "     -"
            print(f"{r['tokens']:7d} {r['impl']:8s} {r['time_ms']:9.2f} {r['peak_extra_gib']:9.2f} "
                  f"{r['achieved_gbps']:8.0f} {pct}")  # fmt: skip
    now = datetime.datetime.now(datetime.UTC)
    result["date"] = now.isoformat(timespec="seconds")
    result["machine"] = {
        "node": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "cpus": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    out = args.out or RESULTS / f"bench_logprob_{result['mode']}_{now:%Y%m%d}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
