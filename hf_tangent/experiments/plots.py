"""matplotlib figures saved as PNG next to the reports (Agg backend: no display needed)."""

from __future__ import annotations

import math

from ..training.extras import needs_recipes


def _pyplot():
    with needs_recipes("plotting"):
        import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def gate_profile(gates: dict[int, float], path: str, title: str = "Calibrated FFN gates") -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    layers = sorted(gates)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--", label="natural (1.0)")
    ax.plot(layers, [gates[i] for i in layers], marker="o", label="calibrated gate")
    ax.set(xlabel="layer", ylabel="gate alpha_l", title=title)
    ax.legend()
    return _save(fig, path)


def loss_curves(curves: dict[str, list[list[tuple[int, float]]]], path: str, title: str = "Training loss",
                levels: dict[str, float] | None = None) -> str:
    """curves: variant -> one (step, loss) list per seed; plots the seed mean with a min..max band.
    levels: named losses drawn as horizontal lines (e.g. the same windows before and after training)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for variant, runs in curves.items():
        steps = sorted({s for run in runs for s, _ in run})
        table = [dict(run) for run in runs]
        values = [[t[s] for t in table if s in t] for s in steps]
        mean = [sum(v) / len(v) for v in values]
        line, = ax.plot(steps, mean, label=variant, alpha=0.6 if levels else 1.0)
        if len(runs) > 1:
            ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=line.get_color(), alpha=0.2)
    for (name, value), style in zip((levels or {}).items(), ("--", "-"), strict=False):
        ax.axhline(value, color="black", lw=1.2, ls=style, label=f"{name}: {value:.4f}")
    ax.set(xlabel="optimizer step", ylabel="training loss", title=title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def drawn_rules(rows: list[dict]) -> list[dict]:
    """The rows `rule_deltas` draws: every rule but the unpatched model with a finite delta NLL (a NaN or inf row,
    e.g. an fp16 overflow, stays in the report's table)."""
    return [r for r in rows if r["variant"] != "unpatched" and math.isfinite(r["delta_nll"]) and abs(r["delta_nll"]) < 1e6]


def rule_deltas(rows: list[dict], path: str, title: str = "Update rules, untrained, every layer") -> str:
    """Delta NLL against the unpatched model per update rule (drawn_rules), horizontal bars on a log scale (the
    rules span four orders of magnitude); rows at or below 1e-4 get a stub bar and their value."""
    plt = _pyplot()
    rows = drawn_rules(rows)
    fig, ax = plt.subplots(figsize=(7, 0.4 * len(rows) + 1.2))
    shown = [max(r["delta_nll"], 1e-4) for r in rows]
    bars = ax.barh([r["variant"] for r in rows], shown, color=["tab:grey" if r["delta_nll"] <= 1e-4 else "tab:red"
                                                              for r in rows])
    for bar, r in zip(bars, rows, strict=True):
        ax.text(bar.get_width() * 1.15, bar.get_y() + bar.get_height() / 2, f"{r['delta_nll']:+.3f}",
                va="center", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(1e-4, max(shown) * 8)
    ax.invert_yaxis()
    ax.set(xlabel="delta NLL vs the unpatched model (nats per token, log scale)", title=title)
    return _save(fig, path)


def diagnostics_layers(records: list[dict], path: str, title: str = "Per-layer diagnostics") -> str:
    """Four panels over layers: diversity before/after attention/after FFN; rho and orthogonality
    error; residual norm; deficit, FFN share and FFN step angle. Means with 5-95% bands."""
    plt = _pyplot()
    layers = [r["layer"] for r in records]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    panels = [
        (axes[0, 0], ["diversity_before_attention", "diversity_after_attention", "diversity_after_ffn"],
         "spherical diversity D"),
        (axes[0, 1], ["rho", "orthogonality_error"], "radial fraction / orthogonality error"),
        (axes[1, 0], ["norm_x", "norm_out"], "residual norm"),
        (axes[1, 1], ["deficit", "ffn_share", "ffn_angle"], "deficit / FFN share / FFN angle (rad)"),
    ]
    for ax, names, label in panels:
        for name in names:
            mean = [r[name]["mean"] for r in records]
            line, = ax.plot(layers, mean, marker=".", label=name)
            if "q05" in records[0][name]:
                ax.fill_between(layers, [r[name]["q05"] for r in records], [r[name]["q95"] for r in records],
                                color=line.get_color(), alpha=0.15)
        ax.set(xlabel="layer", ylabel=label)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    return _save(fig, path)


def ablation_bars(rows: list[dict], path: str, title: str = "Loss increase over full") -> str:
    plt = _pyplot()
    rows = [r for r in rows if r["layer"] == "all"]
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r["variant"] for r in rows]
    means = [r["increase"] for r in rows]
    errors = [[m - r["ci_low"] for m, r in zip(means, rows, strict=True)],
              [r["ci_high"] - m for m, r in zip(means, rows, strict=True)]]
    ax.bar(names, means, yerr=errors, capsize=4, color="tab:blue")
    ax.set_ylabel("loss increase (nats/token), 95% CI")
    ax.set_yscale("symlog", linthresh=0.1)
    ax.set_title(title)
    return _save(fig, path)


def ablation_heatmap(rows: list[dict], path: str, title: str = "Loss increase, one layer at a time") -> str:
    plt = _pyplot()
    rows = [r for r in rows if r["layer"] != "all"]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    layers = sorted({r["layer"] for r in rows})
    grid = [[next(r["increase"] for r in rows if r["variant"] == v and r["layer"] == i) for i in layers] for v in variants]
    fig, ax = plt.subplots(figsize=(max(6, 0.3 * len(layers) + 2), 1 + 0.6 * len(variants)))
    image = ax.imshow(grid, aspect="auto", cmap="magma")
    ax.set_yticks(range(len(variants)), variants)
    ax.set_xticks(range(len(layers)), layers, fontsize=7)
    ax.set_xlabel("layer")
    fig.colorbar(image, ax=ax, label="loss increase (nats/token)")
    ax.set_title(title)
    return _save(fig, path)


def sensitivity_profile(layers: list[dict], path: str, title: str = "FFN input sensitivity C_l") -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    rows = [r for r in layers if not r["already_parallel"]]
    ax.bar([r["layer"] for r in rows], [r["window_mean"] for r in rows], yerr=[r["window_std"] for r in rows],
           capsize=2, color="tab:green")
    ax.set(xlabel="layer", ylabel="C_l (mean, +- sd over windows)", title=title)
    return _save(fig, path)


def parallel_sweep(curves: dict, random_std: dict, path: str, title: str = "Parallel-residual conversion") -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    styles = {"low_c": "tab:green", "high_c": "tab:red", "random": "tab:grey", "greedy": "tab:blue"}
    for schedule, curve in curves.items():
        ks = sorted(curve)
        ax.plot(ks, [curve[k] for k in ks], marker=".", label=schedule, color=styles.get(schedule))
        if schedule == "random" and random_std:
            ax.fill_between(ks, [curve[k] - random_std.get(k, 0) for k in ks],
                            [curve[k] + random_std.get(k, 0) for k in ks], color="tab:grey", alpha=0.2)
    ax.set(xlabel="layers converted (k)", ylabel="held-out loss increase (nats/token)")
    ax.set_yscale("symlog", linthresh=0.01)
    ax.set_title(title)
    ax.legend()
    return _save(fig, path)


LABEL_COLORS = {"attractor": "tab:blue", "saddle": "tab:orange", "repeller": "tab:red", "neutral": "tab:grey"}


def critical_eigenvalues(spectra: dict[str, list[list[list[float]]]], path: str, title: str) -> str:
    """One panel per field: the tangent-Jacobian eigenvalues (Re, Im) of each layer's best candidate,
    divided by their spectral radius so that layers share one scale."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(spectra), figsize=(4.2 * len(spectra), 3.8), squeeze=False)
    for ax, (field, per_layer) in zip(axes[0], spectra.items(), strict=True):
        for eig in per_layer:
            radius = max(math.hypot(a, b) for a, b in eig) or 1.0
            ax.scatter([a / radius for a, _ in eig], [b / radius for _, b in eig], s=2, alpha=0.3)
        ax.axvline(0.0, color="grey", lw=0.8)
        ax.set(xlabel="Re lambda / spectral radius", ylabel="Im lambda / spectral radius", title=f"{field} ({len(per_layer)} layers)")
    fig.suptitle(title)
    return _save(fig, path)


def label_bars(counts: dict[str, dict[int, dict[str, int]]], path: str, title: str) -> str:
    """Stacked bars of candidate labels per layer, one panel per field."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(counts), 1, figsize=(8, 2.4 * len(counts)), squeeze=False, sharex=True)
    for ax, (field, per_layer) in zip(axes[:, 0], counts.items(), strict=True):
        layers = sorted(per_layer)
        bottom = [0] * len(layers)
        for label, color in LABEL_COLORS.items():
            values = [per_layer[i].get(label, 0) for i in layers]
            ax.bar(layers, values, bottom=bottom, color=color, label=label)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set_ylabel(f"{field}\ncandidates")
    axes[0, 0].legend(fontsize=7, ncol=4)
    axes[-1, 0].set_xlabel("layer")
    fig.suptitle(title)
    return _save(fig, path)


def pressure_curves(summary: list[dict], path: str, title: str) -> str:
    """D at the last layer's output and the mean FFN lift against the attention logit factor."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for variant in dict.fromkeys(r["variant"] for r in summary):
        rows = sorted((r for r in summary if r["variant"] == variant), key=lambda r: -r["factor"])
        x = [r["factor"] for r in rows]
        axes[0].plot(x, [r["output"] for r in rows], marker="o", label=variant)
        axes[1].plot(x, [r["ffn_lift"] for r in rows], marker="o", label=variant)
    for ax, ylabel in zip(axes, ("D at the output", "mean FFN lift of D (after FFN - after attention)"), strict=True):
        ax.invert_xaxis()  # left to right: more pressure
        ax.set(xlabel="attention logit factor (1: model, 0: uniform average)", ylabel=ylabel)
    axes[1].axhline(0.0, color="grey", lw=0.8)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def gain_histograms(rows: list[dict], path: str, title: str, panels: int = 6) -> str:
    """Histograms of the activation derivative sigma'(z) at the pre-activations, for a few layers."""
    plt = _pyplot()
    chosen = rows if len(rows) <= panels else [rows[round(k * (len(rows) - 1) / (panels - 1))] for k in range(panels)]
    fig, axes = plt.subplots(1, len(chosen), figsize=(2.6 * len(chosen), 2.8), squeeze=False, sharey=True)
    for ax, r in zip(axes[0], chosen, strict=True):
        counts = r["gain_histogram"]
        width = 2.0 / len(counts)
        total = sum(counts) or 1.0
        ax.bar([-0.5 + width * (k + 0.5) for k in range(len(counts))], [c / total for c in counts], width=width)
        ax.set_title(f"layer {r['layer']}", fontsize=9)
        ax.set_xlabel("sigma'(z)")
    axes[0, 0].set_ylabel("fraction of units")
    fig.suptitle(title)
    return _save(fig, path)


def shown_difference(paired: dict, task: str) -> str | None:
    """The difference a task's panel shows: accuracy for a multiple-choice or exact-match task, bits per
    byte for a perplexity (rolling) task; None when no variant has either."""
    return next((m for m in ("acc", "bits_per_byte") if any(m in p.get(task, {}) for p in paired.values())), None)


def paired_differences(paired: dict, tasks: list[str], path: str, title: str) -> str:
    """Per task (a group's subtasks each get a panel), each variant's difference against the unpatched
    model with its 95% interval: acc, or bits_per_byte for a perplexity task."""
    plt = _pyplot()
    shown = [(task, metric) for task in tasks if (metric := shown_difference(paired, task))]
    fig, axes = plt.subplots(1, max(len(shown), 1), figsize=(5 * max(len(shown), 1), 3.6), squeeze=False)
    if not shown:
        axes[0][0].text(0.5, 0.5, "nothing paired", ha="center", va="center")
    for ax, (task, metric) in zip(axes[0][:len(shown)], shown, strict=True):
        variants = [v for v in paired if metric in paired[v].get(task, {})]
        diffs = [paired[v][task][metric] for v in variants]
        y = range(len(variants))
        ax.errorbar([d["diff"] for d in diffs], list(y), xerr=[[d["diff"] - d["low"] for d in diffs],
                                                               [d["high"] - d["diff"] for d in diffs]], fmt="o")
        ax.axvline(0.0, color="grey", lw=0.8)
        ax.set_yticks(list(y))
        ax.set_yticklabels([v[-28:] for v in variants], fontsize=7)
        ax.set(xlabel=f"{metric} - {metric}(unpatched)", title=task)
    fig.suptitle(title)
    return _save(fig, path)
