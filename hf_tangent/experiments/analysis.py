"""Analyses of a frozen model: `ablate`, `diagnose_layers`, `layer_sensitivity`, `parallel_sweep`."""

from __future__ import annotations

import copy

import torch

from ..ablation import VARIANTS as ABLATIONS
from ..ablation import forward_passes, run_ablation
from ..config import TangentConfig
from ..data import TextSource
from ..diagnostics import QUANTITIES, diagnose
from ..discovery import architecture, decoder_layers
from ..evaluation import update_variants
from ..parallel import estimated_speedup, greedy_order, recommend, sensitivity, submodule_times, sweep_losses
from ..patching import patch
from ..ranges import LAYER_INDICES, DType, Range, at_least, validated
from ..reports import Report
from ..timing import interleaved_ratio
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

ABLATE_RANGES = {"bootstrap": at_least(1)}
PARALLEL_SWEEP_RANGES = {"calibration_windows": at_least(1), "ks": at_least(0), "greedy_max_k": at_least(1),
                         "budget": Range(0)}  # budget 0: only conversions that lose nothing


def _setup(model, tokenizer, text, seq_len, max_windows, dtype, device, seed, *, calibration=False):
    model, tokenizer, name = resolve_model(model, tokenizer, dtype=dtype, device=device, seed=seed)
    text = TextSource.of(text)
    docs = text.calibration_only_documents() if calibration else text.evaluation_documents()
    env = environment(next(model.parameters()).device, next(model.parameters()).dtype, seed)
    return model, tokenizer, name, text, windows(model, tokenizer, docs, seq_len, max_windows), env


@validated(ABLATE_RANGES)
@entry_point(patched_model="refused")
def ablate(model: Model, tokenizer: Tokenizer = None, *, text: Text = None, variants: list[str] = ABLATIONS, layerwise: bool = False,
           bootstrap: int = 2000, seq_len: int = 512, max_windows: int = 8, batch_size: int = 1,
           dtype: DType = "float32", device: str | None = None, seed: int = 0, progress: bool = True) -> Report:
    """Loss increase of zero-FFN, radial-only, tangential-only and attention-zero over the full model,
    in all layers (and one layer at a time with `layerwise`), with paired bootstrap intervals over
    windows (`bootstrap` resamples, >= 1). The `ablate` report.

    Args (shared by the analyses):
        model, tokenizer: a model name (offline name, folder, hub id), or a loaded model with its tokenizer.
        text: a `TextSource`, a list of documents, or None (the Austen novels).
        seq_len, max_windows, batch_size: windows of `seq_len` tokens, at most `max_windows`, per pass.
        dtype, device, seed: for a model loaded by name; progress: show a progress bar.
        variants: ablations (ablation.VARIANTS); layerwise: also one layer at a time.
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
def diagnose_layers(model: Model, tokenizer: Tokenizer = None, *, text: Text = None, update: str | None = None, layers: list[int] | None = None,
                    seq_len: int = 512, max_windows: int = 8, batch_size: int = 1, dtype: DType = "float32",
                    device: str | None = None, seed: int = 0, progress: bool = True) -> Report:
    """Per-layer radial fraction, norms, angles, diversity and deficit (math.md section 4) of the model,
    or of the model patched with the update variant `update`. The `diagnose` report.

    Args (shared by the analyses):
        model, tokenizer: a model name (offline name, folder, hub id), or a loaded model with its tokenizer.
        text: a `TextSource`, a list of documents, or None (the Austen novels).
        seq_len, max_windows, batch_size: windows of `seq_len` tokens, at most `max_windows`, per pass.
        dtype, device, seed: for a model loaded by name; progress: show a progress bar.
        update: an update variant name (evaluation.update_variants()) or None; layers: which (None = all).
    """
    variants = update_variants()
    if update is not None and update not in variants:
        raise ValueError(f"unknown update variant {update!r}; accepted: {', '.join(variants)}.")
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

    Args (shared by the analyses):
        model, tokenizer: a model name (offline name, folder, hub id), or a loaded model with its tokenizer.
        text: a `TextSource`, a list of documents, or None (the Austen novels).
        seq_len, max_windows, batch_size: windows of `seq_len` tokens, at most `max_windows`, per pass.
        dtype, device, seed: for a model loaded by name; progress: show a progress bar.
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

    Args (shared by the analyses):
        model, tokenizer: a model name (offline name, folder, hub id), or a loaded model with its tokenizer.
        text: a `TextSource`, a list of documents, or None (the Austen novels).
        seq_len, max_windows, batch_size: windows of `seq_len` tokens, at most `max_windows`, per pass.
        dtype, device, seed: for a model loaded by name; progress: show a progress bar.
        calibration_windows: windows of calibration text for C_l, the greedy order and the budget.
        ks: numbers of converted layers (default 0..L); random_seeds: seeds of the random order.
        greedy, greedy_max_k: the loss-aware order, up to greedy_max_k layers.
        budget: nats/token for the recommendation; speed: also measure its speed.
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
