"""Paired statistics: over seeds (every variant of a seed shares its initial weights and data order,
so variants are compared by their per-seed differences: the seed-to-seed spread cancels), and over
items (documents, windows) scored by two models, by a paired percentile bootstrap."""

from __future__ import annotations

import itertools
import math
import statistics

import torch


def paired_permutation_test(deltas: list[float]) -> float:
    """Two-sided p-value of mean(deltas) != 0 by exact sign flips (paired seeds); 1.0 for n < 1."""
    n = len(deltas)
    if n == 0:
        return 1.0
    observed = abs(sum(deltas)) / n
    count = total = 0
    for signs in itertools.product((1, -1), repeat=n):
        total += 1
        count += abs(sum(s * d for s, d in zip(signs, deltas, strict=True))) / n >= observed - 1e-15
    return count / total


def paired_deltas(runs: list[dict], a: str, b: str, metric: str) -> list[float]:
    """metric(a) - metric(b) per seed both were run with, in seed order."""
    by = {(r["variant"], r["seed"]): r[metric] for r in runs}
    return [by[(a, s)] - by[(b, s)] for s in sorted(s for (v, s) in by if v == a) if (b, s) in by]


def paired(runs: list[dict], a: str, b: str, metric: str) -> tuple[float, float]:
    """Mean over shared seeds of metric(a) - metric(b), and its paired permutation p-value."""
    deltas = paired_deltas(runs, a, b, metric)
    return (statistics.fmean(deltas), paired_permutation_test(deltas)) if deltas else (math.nan, math.nan)


def paired_summary(runs: list[dict], baseline: str, metric: str) -> list[dict]:
    """Per variant (in first-seen order): seeds, mean and sd of `metric`, the mean paired delta
    against `baseline` and its p-value (nan for the baseline itself)."""
    variants = list(dict.fromkeys(r["variant"] for r in runs))
    rows = []
    for variant in variants:
        values = [r[metric] for r in runs if r["variant"] == variant]
        deltas = paired_deltas(runs, variant, baseline, metric)
        rows.append({"variant": variant, "seeds": len(values), "mean": statistics.fmean(values),
                     "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
                     "delta_mean": statistics.fmean(deltas) if deltas else math.nan,
                     "p_value": paired_permutation_test(deltas) if variant != baseline else math.nan})
    return rows


def _ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties given their average rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rank correlation (Pearson on average ranks); None below 3 pairs or for a constant side."""
    if len(a) != len(b):
        raise ValueError(f"spearman: {len(a)} and {len(b)} values; the two sides must pair up.")
    if len(a) < 3:
        return None
    ra, rb = _ranks(list(a)), _ranks(list(b))
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    sa = math.sqrt(sum((x - ma) ** 2 for x in ra))
    sb = math.sqrt(sum((y - mb) ** 2 for y in rb))
    if sa == 0 or sb == 0:
        return None
    return sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True)) / (sa * sb)


def bootstrap_interval(strata: list[torch.Tensor], statistic, bootstrap: int, seed: int) -> tuple[float, float]:
    """95 % percentile interval of statistic(resampled strata, dim=1): each stratum (a task's documents,
    a domain's windows) is resampled with replacement on its own, so a stratum keeps its size."""
    g = torch.Generator().manual_seed(seed)
    draws = [s[torch.randint(0, len(s), (bootstrap, len(s)), generator=g)] for s in strata]
    values = statistic(draws, 1)
    low, high = torch.quantile(values, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return low, high


def strata_mean(strata: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """The mean over all items of all strata (size-weighted)."""
    return sum(s.sum(dim) for s in strata) / sum(s.shape[dim] for s in strata)

