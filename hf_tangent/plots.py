"""matplotlib figures saved as PNG next to the reports (Agg backend: no display needed)."""

from __future__ import annotations


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def gate_profile(gates: dict[int, float], path: str, title: str = "Calibrated FFN gates") -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    layers = sorted(gates)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--", label="natural (1.0)")
    ax.plot(layers, [gates[i] for i in layers], marker="o", label="calibrated gate")
    ax.set_xlabel("layer")
    ax.set_ylabel("gate alpha_l")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def loss_curves(curves: dict[str, list[list[tuple[int, float]]]], path: str, title: str = "Training loss") -> str:
    """curves: variant -> one (step, loss) list per seed; plots the seed mean with a min..max band."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for variant, runs in curves.items():
        steps = sorted({s for run in runs for s, _ in run})
        table = [dict(run) for run in runs]
        values = [[t[s] for t in table if s in t] for s in steps]
        mean = [sum(v) / len(v) for v in values]
        line, = ax.plot(steps, mean, label=variant)
        if len(runs) > 1:
            ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=line.get_color(), alpha=0.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
