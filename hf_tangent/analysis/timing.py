"""Interleaved A/B timing (benchmarks, parallel-sweep): ratios against a baseline measured in the same run."""

from __future__ import annotations

import statistics
import time


def interleaved_ratio(baseline, candidate, *, repeats: int = 10, warmup: int = 2, clock=time.perf_counter) -> dict:
    """Run baseline and candidate alternately (order flipped every round) and report the median
    per-round time ratio candidate / baseline with its spread (quartiles: `statistics.quantiles`'
    exclusive method), and the per-round ratios themselves."""
    return interleaved_ratios(baseline, {"candidate": candidate}, repeats=repeats, warmup=warmup, clock=clock)["candidate"]


def interleaved_ratios(baseline, candidates: dict, *, repeats: int = 10, warmup: int = 2, clock=time.perf_counter) -> dict:
    """`interleaved_ratio` for several candidates sharing one baseline: every round runs the baseline and
    each candidate once, in an order rotated (and reversed every other round) so that no candidate always
    follows the same one; per candidate, the median per-round ratio candidate / baseline (that round's)."""
    names = list(candidates)
    fns = [baseline, *(candidates[n] for n in names)]
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for i in range(repeats):
        shift = (i // 2) % len(fns) if len(fns) > 2 else 0  # two: plain alternation
        order = list(range(len(fns)))[shift:] + list(range(len(fns)))[:shift]
        for k in order if i % 2 == 0 else reversed(order):
            start = clock()
            fns[k]()
            times[k].append(clock() - start)
    out = {}
    for j, name in enumerate(names, start=1):
        ratios = [c / b for c, b in zip(times[j], times[0], strict=True)]
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        out[name] = {"ratio_median": statistics.median(ratios), "ratio_q25": q[0], "ratio_q75": q[2],
                     "baseline_median_s": statistics.median(times[0]), "candidate_median_s": statistics.median(times[j]),
                     "repeats": repeats, "ratios": ratios}
    return out
