"""Ablations on a frozen checkpoint (the Feed-Forward Steering paper's experiment ii).

Each variant replaces what a layer adds to the residual, in all layers or one layer at a time:
    full             the model as it is
    zero_ffn         FFN update 0                    (update rule "zero")
    radial_only      FFN update c x                  (update rule "radial")
    tangential_only  FFN update y - c x              (update rule "projected")
    attention_zero   attention output 0, FFN untouched
The loss increase over full is reported per variant with a paired bootstrap interval over windows.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..core.config import TangentConfig
from ..core.discovery import architecture
from ..core.patching import get_config, patch, unpatch
from .evaluation import window_nll

VARIANTS = ("full", "zero_ffn", "radial_only", "tangential_only", "attention_zero")
_RULE_OF = {"zero_ffn": "zero", "radial_only": "radial", "tangential_only": "projected"}


def _zero_attention(module, args, output):
    if isinstance(output, tuple):
        return (torch.zeros_like(output[0]),) + tuple(output[1:])
    return torch.zeros_like(output)


@contextmanager
def ablated(model, variant: str, layers: list[int] | None = None):
    """The model with `variant` applied to `layers` (None = all) for the duration of the block."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown ablation {variant!r}; accepted: {', '.join(VARIANTS)}.")
    if variant == "full":
        yield model
        return
    if variant in _RULE_OF:
        patch(model, TangentConfig(update=_RULE_OF[variant], layers=layers))
        try:
            yield model
        finally:
            unpatch(model)
        return
    spec, decoder = architecture(model)
    chosen = range(len(decoder)) if layers is None else layers
    handles = [spec.submodule(decoder[i], "attention").register_forward_hook(_zero_attention) for i in chosen]
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()


def paired_bootstrap(diffs: torch.Tensor, *, n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile interval of mean(diffs), resampling windows with replacement."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(diffs), (n_boot, len(diffs)), generator=g)
    means = diffs.double()[idx].mean(dim=1)
    tail = (1 - level) / 2
    low, high = torch.quantile(means, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return low, high


def run_ablation(model, windows: torch.Tensor, *, variants=VARIANTS, layerwise: bool = False, batch_size: int = 1,
                 n_boot: int = 2000, seed: int = 0, progress=None) -> dict:
    """Loss (mean NLL per token) of each variant and its increase over full, with 95% intervals."""
    if get_config(model) is not None:
        raise ValueError("run_ablation expects an unpatched (frozen) checkpoint; call hf_tangent.unpatch first.")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown ablations {unknown}; accepted: {', '.join(VARIANTS)}.")
    tokens = windows.shape[1] - 1
    full = window_nll(model, windows, batch_size=batch_size, progress=progress) / tokens  # (n,)
    num_layers = len(architecture(model)[1])
    scopes = [None] + (list(range(num_layers)) if layerwise else [])
    rows = []
    for scope in scopes:
        for variant in variants:
            if variant == "full":
                continue
            if progress is not None:
                progress.set_postfix_str(f"{variant} @ {'all' if scope is None else f'layer {scope}'}")
            with ablated(model, variant, None if scope is None else [scope]):
                loss = window_nll(model, windows, batch_size=batch_size, progress=progress) / tokens
            diffs = loss - full
            low, high = paired_bootstrap(diffs, n_boot=n_boot, seed=seed)
            rows.append({"variant": variant, "layer": "all" if scope is None else scope, "loss": loss.mean().item(),
                         "increase": diffs.mean().item(), "ci_low": low, "ci_high": high})
    return {"full_loss": full.mean().item(), "windows": len(windows), "tokens_per_window": tokens,
            "num_layers": num_layers, "rows": rows}


def forward_passes(num_windows: int, variants=VARIANTS, layerwise: bool = False, num_layers: int = 0) -> int:
    """Windows evaluated by `run_ablation` (for progress bars)."""
    ablations = len([v for v in variants if v != "full"])
    return num_windows * (1 + ablations * (1 + (num_layers if layerwise else 0)))
