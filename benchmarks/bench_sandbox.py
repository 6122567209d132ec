"""The per-call cost of the python tool's kernel isolation: `print(1)` under bubblewrap + seccomp (`isolation:
auto`) against the same call without it (`isolation: none`), each call a fresh sandbox. The two are interleaved
`--calls` times; the median and the quartiles of each are printed, with the machine's load average.

    python benchmarks/bench_sandbox.py --calls 50
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from megatron_rl.rollout.agent.tools.python_sandbox import PythonSandbox


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    tools = {mode: PythonSandbox(isolation=mode, timeout_s=60) for mode in ("auto", "none")}  # the probe: not timed
    times: dict[str, list[float]] = {mode: [] for mode in tools}
    for _ in range(args.calls):
        for mode, tool in tools.items():
            start = time.perf_counter()
            answer = tool({"code": "print(1)"})
            times[mode].append(time.perf_counter() - start)
            assert answer == "1", answer
    report = {"calls": args.calls, "load_average": os.getloadavg()}
    for mode, values in times.items():
        q1, median, q3 = statistics.quantiles(values, n=4)
        report[mode] = {"median_ms": round(median * 1e3, 1), "q1_ms": round(q1 * 1e3, 1), "q3_ms": round(q3 * 1e3, 1)}
    report["overhead_ms"] = round(report["auto"]["median_ms"] - report["none"]["median_ms"], 1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
