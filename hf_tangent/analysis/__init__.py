"""Measuring a model, patched or not: perplexity and the rule table (evaluation.py; the `evaluate` metric it loads by path is metrics/), per-layer
diagnostics, the paper's ablations, C_l and parallel conversion (parallel.py), residual geometry
(geometry/), and the statistics they report (stats.py, timing.py)."""
