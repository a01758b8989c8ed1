"""Interleaved A/B timing (benchmarks, parallel-sweep): ratios against a baseline measured in the same run."""

from __future__ import annotations

import statistics
import time


def interleaved_ratio(baseline, candidate, *, repeats: int = 10, warmup: int = 2, clock=time.perf_counter) -> dict:
    """Run baseline and candidate alternately (order flipped every round) and report the median
    per-round time ratio candidate / baseline with its spread (quartiles: `statistics.quantiles`'
    exclusive method), and the per-round ratios themselves."""
    for _ in range(warmup):
        baseline()
        candidate()
    ratios, base_times, cand_times = [], [], []
    for i in range(repeats):
        order = (baseline, candidate) if i % 2 == 0 else (candidate, baseline)
        times = {}
        for fn in order:
            start = clock()
            fn()
            times[fn] = clock() - start
        base_times.append(times[baseline])
        cand_times.append(times[candidate])
        ratios.append(times[candidate] / times[baseline])
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {"ratio_median": statistics.median(ratios), "ratio_q25": q[0], "ratio_q75": q[2],
            "baseline_median_s": statistics.median(base_times), "candidate_median_s": statistics.median(cand_times),
            "repeats": repeats, "ratios": ratios}


def emit(result: dict, output: str | None = None) -> dict:
    """Print a benchmark result as JSON and, if `output` is given, write it there."""
    import json
    from pathlib import Path

    text = json.dumps(result, indent=2)
    print(text)
    if output:
        Path(output).write_text(text)
    return result
