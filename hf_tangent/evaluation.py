"""Perplexity: token-weighted mean next-token NLL over packed windows."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


@torch.no_grad()
def window_nll(model, windows: torch.Tensor, *, batch_size: int = 1, progress=None) -> torch.Tensor:
    """Summed next-token NLL of each window, (n,), in float64; each window predicts seq_len - 1 tokens."""
    device = next(model.parameters()).device
    sums = []
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size].to(device)  # (b, T)
        logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()  # (b, T-1, V)
        targets = batch[:, 1:]  # (b, T-1)
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
        nll = nll.view(targets.shape)  # (b, T-1)
        sums.append(nll.sum(-1).double().cpu())
        if progress is not None:
            progress.update(len(batch))
    return torch.cat(sums)


def perplexity(model, windows: torch.Tensor, **kwargs) -> dict:
    """{'nll', 'perplexity', 'tokens', 'window_nll'}: nll is the token-weighted mean."""
    sums = window_nll(model, windows, **kwargs)
    tokens = windows.shape[0] * (windows.shape[1] - 1)
    nll = sums.sum().item() / tokens
    return {"nll": nll, "perplexity": math.exp(nll), "tokens": tokens,
            "window_nll": (sums / (windows.shape[1] - 1)).tolist()}


def update_variants() -> dict:
    """The update rules compared by `hf-tangent eval`, by display name (None = unpatched)."""
    from .config import TangentConfig

    return {
        "unpatched": None,
        "add": TangentConfig(update="add"),
        "projected": TangentConfig(update="projected"),
        "soft beta=0.5": TangentConfig(update="soft", beta=0.5),
        "norm_preserving": TangentConfig(update="norm_preserving"),
        "retract p=1 (proj)": TangentConfig(update="retract", retraction="proj"),
        "retract p=2 (cayley)": TangentConfig(update="retract", retraction="cayley"),
        "retract p=inf (exp)": TangentConfig(update="retract", retraction="exp"),
        "radial (ablation)": TangentConfig(update="radial"),
        "zero (ablation)": TangentConfig(update="zero"),
    }
