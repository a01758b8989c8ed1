"""Analyses of a frozen model: `ablate`, `diagnose_layers`, `layer_sensitivity`, `parallel_sweep`.

The arguments they share (and geometry.py's analyses):
    model, tokenizer: a model name (offline name, folder, hub id), or a loaded model with its tokenizer.
    text: a `TextSource`, a list of documents, or None (the Austen novels).
    seq_len, max_windows, batch_size: windows of `seq_len` tokens, at most `max_windows`, per pass.
    dtype, device, seed: for a model loaded by name; progress: show a progress bar.
Each function's own are in its docstring's `Args:`, one per line: an analysis command's help (commands/analyses.py).
"""

from __future__ import annotations

import copy
import os
from typing import Literal

import torch

from ..analysis.ablation import VARIANTS as ABLATIONS
from ..analysis.ablation import forward_passes, run_ablation
from ..analysis.diagnostics import QUANTITIES, diagnose
from ..analysis.evaluation import UpdateName, update_variants
from ..analysis.parallel import estimated_speedup, greedy_order, recommend, sensitivity, submodule_times, sweep_losses
from ..analysis.timing import interleaved_ratio
from ..core.config import TangentConfig
from ..core.discovery import architecture, decoder_layers
from ..core.patching import patch
from ..ranges import LAYER_INDICES, DType, Range, at_least, validated
from ..training.data import TextSource
from . import plots
from .common import (
    Clock,
    Model,
    Text,
    Tokenizer,
    entry_point,
    environment,
    progress_bar,
    refuse_patched,
    resolve_model,
    windows,
)
from .report import Report, register_report

Ablation = Literal[ABLATIONS]
ABLATE_RANGES = {"bootstrap": at_least(1)}
PARALLEL_SWEEP_RANGES = {"calibration_windows": at_least(1), "ks": at_least(0), "greedy_max_k": at_least(1),
                         "budget": Range(0)}  # budget 0: only conversions that lose nothing


def _setup(model, tokenizer, text, seq_len, max_windows, dtype, device, seed, *, calibration=False):
    model, tokenizer, name = resolve_model(model, tokenizer, dtype=dtype, device=device, seed=seed)
    text = TextSource.of(text)
    docs = text.calibration_only_documents() if calibration else text.evaluation_documents()
    env = environment(next(model.parameters()).device, next(model.parameters()).dtype, seed, model=model, text=text,
                      read={"calibration" if calibration else "evaluation": docs})
    return model, tokenizer, name, text, windows(model, tokenizer, docs, seq_len, max_windows), env


@validated(ABLATE_RANGES)
@entry_point(patched_model="refused")
def ablate(model: Model, tokenizer: Tokenizer = None, *, text: Text = None, variants: list[Ablation] = ABLATIONS, layerwise: bool = False,
           bootstrap: int = 2000, seq_len: int = 512, max_windows: int = 8, batch_size: int = 1,
           dtype: DType = "float32", device: str | None = None, seed: int = 0, progress: bool = True) -> Report:
    """Loss increase of zero-FFN, radial-only, tangential-only and attention-zero over the full model,
    in all layers (and one layer at a time with `layerwise`), with paired bootstrap intervals over
    windows (`bootstrap` resamples, >= 1). The `ablate` report.

    Args:
        model, tokenizer, text, seq_len, max_windows, batch_size, dtype, device, seed, progress: as every analysis (this module's docstring).
        variants: ablations to run
        layerwise: also ablate one layer at a time (layers x variants forward passes)
        bootstrap: bootstrap resamples for the 95% intervals (>= 1)
    """
    model, _, name, text, held_out, env = _setup(model, tokenizer, text, seq_len, max_windows, dtype, device, seed)
    clock = Clock()
    total = forward_passes(len(held_out), variants, layerwise, len(decoder_layers(model)))
    with progress_bar(progress, total, "hf-tangent ablate") as bar:
        result = run_ablation(model, held_out, variants=variants, layerwise=layerwise, batch_size=batch_size,
                              n_boot=bootstrap, seed=seed, progress=bar)
    return Report("ablate", {"command": "ablate", "model": name, "text": text.describe(), "seq_len": seq_len,
                             "seconds": clock.seconds, **env, **result})


@validated({"layers": LAYER_INDICES})
@entry_point(patched_model="as is")
def diagnose_layers(model: Model, tokenizer: Tokenizer = None, *, text: Text = None, update: UpdateName | None = None, layers: list[int] | None = None,
                    seq_len: int = 512, max_windows: int = 8, batch_size: int = 1, dtype: DType = "float32",
                    device: str | None = None, seed: int = 0, progress: bool = True) -> Report:
    """Per-layer radial fraction, norms, angles, diversity and deficit (math.md section 4) of the model,
    or of the model patched with the update variant `update`. The `diagnose` report.

    Args:
        model, tokenizer, text, seq_len, max_windows, batch_size, dtype, device, seed, progress: as every analysis (this module's docstring).
        update: diagnose the model patched with this update variant (default: unpatched)
        layers: layers to observe (default all)
    """
    variants = update_variants()
    model, _, name, text, held_out, env = _setup(model, tokenizer, text, seq_len, max_windows, dtype, device, seed)
    if update and variants[update] is not None:
        refuse_patched(model, "diagnose_layers")  # update= patches the unpatched model (undone on return)
        patch(model, variants[update])
    clock = Clock()
    with progress_bar(progress, len(held_out), "hf-tangent diagnose") as bar:
        records = diagnose(model, held_out, layers=layers, batch_size=batch_size, progress=bar)
    return Report("diagnose", {"command": "diagnose", "model": name, "update": update or "unpatched",
                               "text": text.describe(), "seq_len": seq_len, "windows": len(held_out),
                               "definitions": QUANTITIES, "seconds": clock.seconds, **env, "layers": records})


@validated()
@entry_point(patched_model="refused")
def layer_sensitivity(model: Model, tokenizer: Tokenizer = None, *, text: Text = None, seq_len: int = 512, max_windows: int = 8,
                      batch_size: int = 1, dtype: DType = "float32", device: str | None = None, seed: int = 0,
                      progress: bool = True) -> Report:
    """C_l, the FFN input-sensitivity of every layer, on calibration text (`text.calibration_files`,
    default: the Austen calibration novels). The `sensitivity` report.

    Args:
        model, tokenizer, text, seq_len, max_windows, batch_size, dtype, device, seed, progress: as every analysis (this module's docstring).
    """
    model, _, name, text, calibration, env = _setup(model, tokenizer, text, seq_len, max_windows, dtype, device,
                                                    seed, calibration=True)
    clock = Clock()
    with progress_bar(progress, len(calibration), "hf-tangent sensitivity") as bar:
        result = sensitivity(model, calibration, batch_size=batch_size, progress=bar)
    return Report("sensitivity", {"command": "sensitivity", "model": name, "seq_len": seq_len,
                                  "text": text.describe_calibration(), "seconds": clock.seconds, **env, **result})


@validated(PARALLEL_SWEEP_RANGES)
@entry_point(patched_model="refused")
def parallel_sweep(model: Model, tokenizer: Tokenizer = None, *, text: Text = None, calibration_windows: int = 4, ks: list[int] | None = None,
                   random_seeds: list[int] = (0, 1, 2), greedy: bool = True, greedy_max_k: int | None = None,
                   budget: float = 0.02, speed: bool = True, seq_len: int = 512, max_windows: int = 8,
                   batch_size: int = 1, dtype: DType = "float32", device: str | None = None, seed: int = 0,
                   progress: bool = True) -> Report:
    """Held-out loss against the number of parallel-converted layers under the low-C_l, high-C_l,
    random and greedy orders; the largest set within `budget` nats; its estimated and measured
    speed. The `parallel-sweep` report.

    Args:
        model, tokenizer, text, seq_len, max_windows, batch_size, dtype, device, seed, progress: as every analysis (this module's docstring).
        calibration_windows: calibration windows (C_l, greedy, budget)
        ks: numbers of converted layers to evaluate (default 0..L)
        random_seeds: seeds of the random order
        greedy: also the loss-aware greedy selection (O(L^2) evaluations)
        greedy_max_k: stop the greedy selection after this many layers
        budget: loss budget (nats/token) for the recommendation
        speed: measure T_A, T_Phi and the end-to-end latency of the recommended conversion
    """
    model, tokenizer, name, text, held_out, env = _setup(model, tokenizer, text, seq_len, max_windows, dtype, device, seed)
    calibration = windows(model, tokenizer, text.calibration_only_documents(), seq_len, calibration_windows)
    clock = Clock()
    sens = sensitivity(model, calibration, batch_size=batch_size)
    convertible = [i for i, c in enumerate(sens["scores"]) if c is not None]
    if not convertible:
        raise ValueError("every layer is already a parallel-residual block (use_parallel_residual=True): nothing to convert.")
    order = None
    if greedy:
        max_k = greedy_max_k or len(convertible)
        with progress_bar(progress, sum(len(convertible) - j for j in range(max_k)), "greedy selection", "eval") as bar:
            order = greedy_order(model, calibration, max_k=max_k, batch_size=batch_size, progress=bar)
    ks = list(range(len(convertible) + 1)) if ks is None else list(ks)
    with progress_bar(progress, len(ks) * (2 + len(random_seeds) + bool(order)), "sweep (held-out)", "eval") as bar:
        sweep = sweep_losses(model, held_out, scores=sens["scores"], ks=ks, random_seeds=random_seeds, greedy=order,
                             batch_size=batch_size, progress=bar)
    orders = {"low_c": sorted(convertible, key=lambda i: sens["scores"][i])}
    if order:
        orders["greedy"] = [step["layer"] for step in order]
    recommendations = {k: recommend(model, calibration, held_out, budget=budget, order=o, batch_size=batch_size)
                       for k, o in orders.items()}
    best = max(recommendations.values(), key=lambda r: (r["within_budget_heldout"], r["k"]))
    return Report("parallel-sweep", {
        "command": "parallel-sweep", "model": name, "seq_len": seq_len, "heldout_windows": len(held_out),
        "calibration_windows": len(calibration),
        "text": {"evaluation": text.describe(), "calibration": text.describe_calibration()},
        "sensitivity": sens, "greedy": order, "sweep": sweep, "recommendations": recommendations,
        "speed": measure_speed(model, held_out, best["layers"], batch_size) if speed and best["layers"] else None,
        "seconds": clock.seconds, **env})


def measure_speed(model, held_out: torch.Tensor, layers: list[int], batch_size: int = 1) -> dict:
    """Estimated speedup of converting `layers` (from measured T_A, T_Phi) beside the measured
    end-to-end time ratio of the converted model (hooks, and fused where the architecture has it)."""
    times = submodule_times(model, held_out[:2], batch_size=batch_size)
    ids = held_out[:1].to(next(model.parameters()).device)
    variants = {"hooks": TangentConfig(parallel_layers=tuple(layers))}
    if architecture(model)[0].fused_attention_in:
        variants["fused"] = TangentConfig(parallel_layers=tuple(layers), parallel_execution="fused")

    @torch.no_grad()
    def run(m):
        m(input_ids=ids, use_cache=False)

    measured = {}
    for name, config in variants.items():
        converted = patch(copy.deepcopy(model), config)
        measured[name] = interleaved_ratio(lambda: run(model), lambda conv=converted: run(conv), repeats=7)
    return {"layers": layers, "estimated_speedup": estimated_speedup(times, layers), "submodule_times": times,
            "measured_time_ratio": {k: v["ratio_median"] for k, v in measured.items()},
            "measured_speedup": {k: 1.0 / v["ratio_median"] for k, v in measured.items()},
            "measured": measured, "tokens": int(ids.numel())}


# The rendering of its reports (Markdown, plots): report.py keeps one table of kinds.

def diagnose_markdown(report: dict) -> str:
    cols = ["rho", "orthogonality_error", "norm_x", "ffn_angle", "diversity_before_attention",
            "diversity_after_attention", "diversity_after_ffn", "deficit", "ffn_share"]
    lines = [f"# hf-tangent diagnose: {report['model']} ({report['update']})", "",
             f"{report['windows']} windows x {report['seq_len']} tokens of {report['text']}; per-layer means over "
             "tokens (diversity: mean over sequences). Definitions: docs/diagnostics.md.", "",
             "| layer | " + " | ".join(cols) + " | norm drift |", "|---" * (len(cols) + 2) + "|"]
    for r in report["layers"]:
        lines.append(f"| {r['layer']} | " + " | ".join(f"{r[c]['mean']:.4g}" for c in cols) + f" | {r['norm_drift']:.4g} |")
    lines += ["", "![per-layer diagnostics](diagnostics_layers.png)"]
    return "\n".join(lines) + "\n"


def ablate_markdown(report: dict) -> str:
    lines = [f"# hf-tangent ablate: {report['model']}", "",
             f"Full model loss {report['full_loss']:.4f} nats/token on {report['windows']} windows x "
             f"{report['seq_len']} tokens of {report['text']}; increase over full with a 95% paired bootstrap "
             "interval over windows.", "",
             "| variant | layers | loss | increase | 95% CI |", "|---|---|---:|---:|---|"]
    for r in report["rows"]:
        if r["layer"] == "all":
            lines.append(f"| {r['variant']} | all | {r['loss']:.4f} | {r['increase']:+.4f} | "
                         f"[{r['ci_low']:+.4f}, {r['ci_high']:+.4f}] |")
    layerwise = [r for r in report["rows"] if r["layer"] != "all"]
    if layerwise:
        variants = list(dict.fromkeys(r["variant"] for r in layerwise))
        lines += ["", "One layer at a time (loss increase):", "", "| layer | " + " | ".join(variants) + " |",
                  "|---" * (len(variants) + 1) + "|"]
        for layer in sorted({r["layer"] for r in layerwise}):
            cells = [next(r for r in layerwise if r["layer"] == layer and r["variant"] == v) for v in variants]
            lines.append(f"| {layer} | " + " | ".join(f"{c['increase']:+.4f}" for c in cells) + " |")
        lines += ["", "![layerwise](ablation_heatmap.png)"]
    lines += ["", "![ablations](ablation_bars.png)"]
    return "\n".join(lines) + "\n"


def sensitivity_markdown(report: dict) -> str:
    lines = [f"# hf-tangent sensitivity: {report['model']}", "",
             f"C_l on {report['windows']} calibration windows x {report['seq_len']} tokens of {report['text']}.", ""]
    if report["already_parallel"]:
        lines += [f"Layers {report['already_parallel']} are already parallel-residual blocks: nothing to convert there.", ""]
    lines += ["| layer | C_l (token mean) | window mean +- sd | q05 .. q95 |", "|---:|---:|---:|---|"]
    for r in report["layers"]:
        if not r["already_parallel"]:
            t = r["token_stats"]
            lines.append(f"| {r['layer']} | {r['c']:.4f} | {r['window_mean']:.4f} +- {r['window_std']:.4f} | "
                         f"{t['q05']:.3f} .. {t['q95']:.3f} |")
    return "\n".join(lines + ["", "![C_l](sensitivity.png)"]) + "\n"


def sweep_markdown(report: dict) -> str:
    sweep = report["sweep"]
    curves = _int_keys(sweep["curves"])
    schedules = list(curves)
    lines = [f"# hf-tangent parallel-sweep: {report['model']}", "",
             f"Held-out loss {sweep['base_loss']:.4f} nats/token unconverted ({report['heldout_windows']} windows x "
             f"{report['seq_len']} tokens); C_l and greedy on {report['calibration_windows']} calibration windows. "
             "Loss increase by number of converted layers (random: mean over seeds):", "",
             "| k | " + " | ".join(schedules) + " |", "|---:" * (len(schedules) + 1) + "|"]
    for k in sweep["ks"]:
        lines.append(f"| {k} | " + " | ".join(f"{curves[s][k]:+.4f}" if k in curves[s] else "-" for s in schedules) + " |")
    lines += ["", "![sweep](parallel_sweep.png)", "", f"## Largest set within +{next(iter(report['recommendations'].values()))['budget']} nats (chosen on calibration text)", "",
              "| order | k | layers | held-out increase | within budget on held-out |", "|---|---:|---|---:|---|"]
    for name, r in report["recommendations"].items():
        lines.append(f"| {name} | {r['k']} | {r['layers']} | {r['heldout_increase']:+.4f} | {r['within_budget_heldout']} |")
    if report["speed"]:
        sp = report["speed"]
        # reports before issue 58 estimated concurrency of A and FFN; since, what fused execution saves
        model = ("fused execution: one norm and three GEMM calls fewer per layer, from measured module times"
                 if "fused_groups" in sp["submodule_times"] else "A and FFN concurrent, from measured T_A, T_Phi")
        lines += ["", "## Speed", "", f"Converted layers {sp['layers']}: estimated speedup ({model}) "
                  f"**{sp['estimated_speedup']:.3f}x**; measured end-to-end (1 x "
                  f"{sp['tokens']} tokens, same run): " + ", ".join(f"{k} {v:.3f}x" for k, v in sp["measured_speedup"].items()) + "."]
    return "\n".join(lines) + "\n"


def _int_keys(curves: dict) -> dict:
    """Sweep curves by schedule and k, with int k (a report read back from JSON has string keys)."""
    return {schedule: {int(k): v for k, v in curve.items()} for schedule, curve in curves.items()}


def _plot_ablate(data, folder):
    out = [plots.ablation_bars(data["rows"], os.path.join(folder, "ablation_bars.png"), title=f"{data['model']}: ablations")]
    if any(r["layer"] != "all" for r in data["rows"]):
        out.append(plots.ablation_heatmap(data["rows"], os.path.join(folder, "ablation_heatmap.png"),
                                          title=f"{data['model']}: one layer at a time"))
    return out


def _plot_sensitivity(data, folder):
    layers = data["layers"] if "layers" in data else data["sensitivity"]["layers"]
    if all(r["already_parallel"] for r in layers):
        return []
    return [plots.sensitivity_profile(layers, os.path.join(folder, "sensitivity.png"), title=f"C_l: {data['model']}")]


def _plot_sweep(data, folder):
    sweep = data["sweep"]
    curves, spread = _int_keys(sweep["curves"]), {int(k): v for k, v in sweep["random_std"].items()}
    return _plot_sensitivity(data, folder) + [plots.parallel_sweep(
        curves, spread, os.path.join(folder, "parallel_sweep.png"), title=f"{data['model']}: parallel-residual conversion")]


def _plot_diagnose(data, folder):
    return [plots.diagnostics_layers(data["layers"], os.path.join(folder, "diagnostics_layers.png"),
                                     title=f"{data['model']} ({data['update']})")]


register_report('diagnose', diagnose_markdown, _plot_diagnose)
register_report('ablate', ablate_markdown, _plot_ablate)
register_report('sensitivity', sensitivity_markdown, _plot_sensitivity)
register_report('parallel-sweep', sweep_markdown, _plot_sweep)
