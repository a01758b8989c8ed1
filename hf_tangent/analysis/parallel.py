"""Layer sensitivity C_l and parallel-residual conversion (Feed-Forward Steering, experiment iv).

    C_l = ||Phi(Norm(x + A)) - Phi(Norm(x))|| / (||Phi(Norm(x + A))|| + eps)    per token, x = block input

(math.md section 4; defined once, in `sensitivity`). Small C_l: the parallel surrogate
x + A(x) + Phi(Norm(x)) is accurate for that layer. Conversion itself is `TangentConfig(parallel_layers=...)`;
`parallelize` picks the layers by a schedule, `sweep_losses` measures the held-out loss for
k = 0..L converted layers, `greedy_order` is the loss-aware selection, `recommend` the largest set
within a loss budget, and `submodule_times` / `estimated_speedup` what fused execution saves.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time

import torch

from ..core.config import TangentConfig
from ..core.discovery import architecture, ffn_branch, first_output
from ..core.patching import get_config, patch, tangent_layers, unpatch
from .diagnostics import RunningStat
from .evaluation import forward_windows, perplexity

SCHEDULES = ("low_c", "high_c", "random")
EPS = 1e-6


@torch.no_grad()
def sensitivity(model, windows: torch.Tensor, *, batch_size: int = 1, progress=None) -> dict:
    """C_l of every layer, streamed: per-token statistics and the spread of per-window means."""
    if len(windows) == 0:
        raise ValueError("sensitivity: no calibration windows (the calibration text is empty).")
    if get_config(model) is not None:
        raise ValueError("sensitivity: measure C_l on the unpatched model (hf_tangent.unpatch first).")
    spec, decoder = architecture(model)
    token_stats = [RunningStat() for _ in decoder]
    window_means: list[list[float]] = [[] for _ in decoder]
    parallel = [i for i, layer in enumerate(decoder) if spec.is_parallel(layer)]
    handles, state = [], {"busy": False}
    for i, layer in enumerate(decoder):
        if i in parallel:
            continue
        seen = {}
        ffn_out, phi = spec.submodule(layer, "ffn_out"), ffn_branch(spec, layer)

        def on_input(module, args, kwargs, seen=seen):
            if not state["busy"]:
                seen["h"] = args[0] if args else kwargs["hidden_states"]

        def on_ffn(module, args, output, seen=seen):
            if not state["busy"]:
                seen["y"] = first_output(output)

        def on_output(module, args, output, seen=seen, i=i, phi=phi):
            state["busy"] = True  # the extra FFN evaluation must not re-trigger these hooks
            try:
                y_parallel = phi(seen["h"])
            finally:
                state["busy"] = False
            y = seen["y"].float()
            c = (y - y_parallel.float()).norm(dim=-1) / (y.norm(dim=-1) + EPS)  # (B, T)
            token_stats[i].update(c)
            window_means[i].extend(c.mean(dim=-1).tolist())
            seen.clear()

        handles += [layer.register_forward_pre_hook(on_input, with_kwargs=True),
                    ffn_out.register_forward_hook(on_ffn), layer.register_forward_hook(on_output)]
    was_training = model.training
    model.eval()
    try:
        for _ in forward_windows(model, windows, batch_size=batch_size, progress=progress):
            pass
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    layers = []
    for i in range(len(decoder)):
        if i in parallel:
            layers.append({"layer": i, "already_parallel": True, "c": None})
            continue
        means = window_means[i]
        layers.append({"layer": i, "already_parallel": False, "c": token_stats[i].summary()["mean"],
                       "token_stats": token_stats[i].summary(),
                       "window_mean": statistics.fmean(means), "window_std": statistics.pstdev(means)})
    return {"layers": layers, "scores": [r["c"] for r in layers], "already_parallel": parallel,
            "windows": len(windows)}


def schedule_layers(scores, n: int, schedule: str, *, seed: int = 0, convertible=None) -> list[int]:
    """The n layers a schedule converts. scores: C_l per layer (None where not convertible)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; accepted: {', '.join(SCHEDULES)}.")
    convertible = [i for i, c in enumerate(scores) if c is not None] if convertible is None else list(convertible)
    if not convertible:
        raise ValueError("every layer is already a parallel-residual block: nothing to convert.")
    if not 0 <= n <= len(convertible):
        raise ValueError(f"n={n} layers to convert, but the model has {len(convertible)} convertible layers "
                         f"(accepted: 0..{len(convertible)}).")
    if schedule == "random":
        return sorted(random.Random(seed).sample(convertible, n))
    ranked = sorted(convertible, key=lambda i: scores[i], reverse=schedule == "high_c")
    return sorted(ranked[:n])


def parallelize(model, layers=None, *, schedule: str | None = None, n: int | None = None, scores=None,
                windows: torch.Tensor | None = None, seed: int = 0, execution: str | None = None):
    """Convert layers to parallel-residual form, keeping the rest of the active patch (and its
    gate values). Either `layers`, or a `schedule` with `n` and C_l `scores` (or calibration
    `windows` to compute them). Returns the model; the converted layers are in get_config(model)."""
    spec, decoder = architecture(model)
    convertible = [i for i, layer in enumerate(decoder) if not spec.is_parallel(layer)]
    if not convertible:
        raise ValueError(f"every layer of this {model.config.model_type} model is already a parallel-residual "
                         "block (use_parallel_residual=True): nothing to convert.")
    if (layers is None) == (schedule is None):
        raise ValueError("parallelize: pass either layers=[...] or schedule=... with n=...")
    current = get_config(model) or TangentConfig()
    gates = {c.index: c.gate.detach().clone() for c in tangent_layers(model) if c.gate is not None}
    if schedule is not None:
        if n is None:
            raise ValueError("parallelize: a schedule needs n, the number of layers to convert.")
        if scores is None and schedule != "random":
            if windows is None:
                raise ValueError(f"parallelize: schedule {schedule!r} needs C_l scores= or calibration windows=.")
            unpatch(model)  # C_l is a property of the unmodified model; the patch is re-applied below
            try:
                scores = sensitivity(model, windows)["scores"]
            finally:
                if current != TangentConfig():
                    _restore(model, current, gates)  # back as it was, also if C_l failed
        layers = schedule_layers(scores if scores is not None else [0.0] * len(decoder), n, schedule, seed=seed,
                                 convertible=convertible)
    changes = {"parallel_layers": tuple(layers)}
    if execution is not None:
        changes["parallel_execution"] = execution
    _restore(model, dataclasses.replace(current, **changes), gates)
    return model


def _restore(model, config: TangentConfig, gates: dict) -> None:
    """Patch with `config` and put the saved gate values back."""
    patch(model, config)
    with torch.no_grad():
        for child in tangent_layers(model):
            if child.gate is not None and child.index in gates:
                child.gate.copy_(gates[child.index])


def _loss(model, windows, batch_size):
    return perplexity(model, windows, batch_size=batch_size)["nll"]


def _with_layers(model, layers, windows, batch_size):
    if layers:
        patch(model, TangentConfig(parallel_layers=tuple(layers)))
    try:
        return _loss(model, windows, batch_size)
    finally:
        unpatch(model)


def greedy_order(model, windows: torch.Tensor, *, max_k: int | None = None, batch_size: int = 1,
                 candidates=None, progress=None) -> list[dict]:
    """Loss-aware selection: repeatedly convert the layer whose conversion costs the least
    calibration loss given those already converted. O(L^2) evaluations of `windows`."""
    spec, decoder = architecture(model)
    remaining = [i for i, layer in enumerate(decoder) if not spec.is_parallel(layer)] if candidates is None else list(candidates)
    max_k = len(remaining) if max_k is None else max_k
    base = _loss(model, windows, batch_size)
    chosen, steps = [], []
    while remaining and len(chosen) < max_k:
        costs = {}
        for i in remaining:
            costs[i] = _with_layers(model, chosen + [i], windows, batch_size) - base
            if progress is not None:
                progress.update(1)
        best = min(costs, key=costs.get)
        chosen.append(best)
        remaining.remove(best)
        steps.append({"k": len(chosen), "layer": best, "calibration_increase": costs[best]})
    return steps


def sweep_losses(model, windows: torch.Tensor, *, scores, ks=None, random_seeds=(0, 1, 2), greedy=None,
                   batch_size: int = 1, progress=None) -> dict:
    """Held-out loss increase for k converted layers under low-C_l, high-C_l, random (mean over
    seeds) and, if `greedy` (an order from greedy_order) is given, the loss-aware schedule."""
    convertible = [i for i, c in enumerate(scores) if c is not None]
    ks = list(range(len(convertible) + 1)) if ks is None else list(ks)
    bad = [k for k in ks if not 0 <= k <= len(convertible)]
    if bad:
        raise ValueError(f"k values {bad} out of range; the model has {len(convertible)} convertible layers.")
    base = _loss(model, windows, batch_size)
    rows = []

    def measure(schedule, k, layers, seed=None):
        loss = base if not layers else _with_layers(model, layers, windows, batch_size)
        rows.append({"schedule": schedule, "k": k, "seed": seed, "layers": list(layers), "loss": loss,
                     "increase": loss - base})
        if progress is not None:
            progress.update(1)

    for k in ks:
        measure("low_c", k, schedule_layers(scores, k, "low_c"))
        measure("high_c", k, schedule_layers(scores, k, "high_c"))
        for seed in random_seeds:
            measure("random", k, schedule_layers(scores, k, "random", seed=seed), seed)
        if greedy is not None and k <= len(greedy):
            measure("greedy", k, sorted(step["layer"] for step in greedy[:k]))
    summary = {}
    for row in rows:
        summary.setdefault(row["schedule"], {}).setdefault(row["k"], []).append(row["increase"])
    curves = {s: {k: statistics.fmean(v) for k, v in by_k.items()} for s, by_k in summary.items()}
    spread = {k: statistics.pstdev(v) for k, v in summary.get("random", {}).items()}
    return {"base_loss": base, "rows": rows, "curves": curves, "random_std": spread, "ks": ks}


def recommend(model, calibration: torch.Tensor, heldout: torch.Tensor, *, budget: float, order: list[int],
              batch_size: int = 1) -> dict:
    """The largest prefix of `order` whose calibration loss increase stays within `budget` (nats),
    verified on held-out text."""
    base = _loss(model, calibration, batch_size)
    best = []
    for k in range(1, len(order) + 1):
        if _with_layers(model, order[:k], calibration, batch_size) - base > budget:
            break
        best = order[:k]
    heldout_base = _loss(model, heldout, batch_size)
    heldout_loss = _with_layers(model, best, heldout, batch_size)
    return {"budget": budget, "layers": sorted(best), "k": len(best),
            "heldout_increase": heldout_loss - heldout_base, "within_budget_heldout": heldout_loss - heldout_base <= budget}


@torch.no_grad()
def submodule_times(model, windows: torch.Tensor, *, repeats: int = 3, batch_size: int = 1,
                    clock=time.perf_counter) -> dict:
    """Median time per call, per layer, of the attention (T_A), the FFN (T_Phi), and what fused parallel
    execution changes: the pre-FFN norm and each input projection (hooks on this device; CUDA synchronised
    around each module). The forward's median time is measured apart, without the hooks."""
    spec, decoder = architecture(model)
    cuda = next(model.parameters()).is_cuda
    projections = list(spec.fused_attention_in + spec.fused_ffn_in)
    roles = ["attention", "mlp", "ffn_norm", *projections]
    samples = {(i, role): [] for i in range(len(decoder)) for role in roles}
    starts, handles = {}, []

    def now():
        if cuda:
            torch.cuda.synchronize()
        return clock()

    for i, layer in enumerate(decoder):
        for role in roles:
            module = layer.get_submodule(role) if role in projections else spec.submodule(layer, role)
            handles.append(module.register_forward_pre_hook(lambda m, a, key=(i, role): starts.__setitem__(key, now())))
            handles.append(module.register_forward_hook(
                lambda m, a, o, key=(i, role): samples[key].append(now() - starts[key])))
    device = next(model.parameters()).device
    batches = [windows[start : start + batch_size].to(device) for start in range(0, len(windows), batch_size)]
    try:
        model(input_ids=batches[0], use_cache=False)  # warm-up
        for v in samples.values():
            v.clear()
        for _ in range(repeats):
            for ids in batches:
                model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    totals = []
    for _ in range(repeats):
        for ids in batches:
            t0 = now()
            model(input_ids=ids, use_cache=False)
            totals.append(now() - t0)
    layers = [{"layer": i, "t_attention": statistics.median(samples[(i, "attention")]),
               "t_ffn": statistics.median(samples[(i, "mlp")]), "t_ffn_norm": statistics.median(samples[(i, "ffn_norm")]),
               "t_projections": [statistics.median(samples[(i, p)]) for p in projections]} for i in range(len(decoder))]
    # the per-call cost of a GEMM: intercept of the projections' times against their weight sizes (least squares)
    sizes = [layer.get_submodule(p).weight.numel() for layer in decoder for p in projections]
    spent = [t for r in layers for t in r["t_projections"]]
    gemm_call = statistics.linear_regression(sizes, spent).intercept if len(set(sizes)) > 1 else 0.0
    return {"layers": layers, "t_forward": statistics.median(totals), "calls": len(totals),
            "fused_groups": 2 if projections else 0, "t_gemm_call": max(gemm_call, 0.0)}


def estimated_speedup(times: dict, layers) -> float:
    """What fused parallel execution saves on `layers`, from the unconverted model's module times: the pre-FFN
    norm no longer normalises (T_norm), and the input projections run as one GEMM per branch, so the per-call
    cost c of a GEMM is paid twice instead of once per projection. Nothing runs concurrently:

        speedup = T_forward / (T_forward - sum over converted layers of (T_norm + (projections - 2) c))

    1.0 without a fused path (the hook conversion runs the same work as the unconverted model)."""
    if not times["fused_groups"]:
        return 1.0
    saved = sum(r["t_ffn_norm"] + (len(r["t_projections"]) - times["fused_groups"]) * times["t_gemm_call"]
                for r in times["layers"] if r["layer"] in set(layers))
    return times["t_forward"] / (times["t_forward"] - saved)
