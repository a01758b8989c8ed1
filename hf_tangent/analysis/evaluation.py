"""Perplexity: token-weighted mean next-token NLL over packed windows, or strided sliding windows.

The same aggregate is shipped as an `evaluate` module: `evaluate.load(PERPLEXITY_METRIC)`.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Literal

import torch
import torch.nn.functional as F

from ..core.config import TangentConfig
from ..core.patching import get_config, patch, unpatch

PERPLEXITY_METRIC = os.path.join(os.path.dirname(__file__), "metrics", "tangent_perplexity")


@contextlib.contextmanager
def eval_mode(model):
    """The model in eval mode inside the block (dropout off); on exit every module's own training
    flag is back as it was, also after an exception."""
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in flags:
            module.training = training


def forward_windows(model, windows: torch.Tensor, *, batch_size: int = 1, progress=None):
    """Yield (batch, model output) over (n, T) token windows, `batch_size` at a time; the progress
    bar advances by windows. Callers run it under torch.no_grad()."""
    device = next(model.parameters()).device
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size].to(device)  # (b, T)
        yield batch, model(input_ids=batch, use_cache=False)
        if progress is not None:
            progress.update(len(batch))


@torch.no_grad()
def window_nll(model, windows: torch.Tensor, *, batch_size: int = 1, progress=None) -> torch.Tensor:
    """Summed next-token NLL of each window, (n,), in float64; each window predicts seq_len - 1 tokens."""
    sums = []
    for batch, output in forward_windows(model, windows, batch_size=batch_size, progress=progress):
        logits = output.logits[:, :-1].float()  # (b, T-1, V)
        targets = batch[:, 1:]  # (b, T-1)
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
        nll = nll.view(targets.shape)  # (b, T-1)
        sums.append(nll.sum(-1).double().cpu())
    return torch.cat(sums)


def perplexity(model, windows: torch.Tensor, **kwargs) -> dict:
    """{'nll', 'perplexity', 'tokens', 'window_nll'}: nll is the token-weighted mean."""
    sums = window_nll(model, windows, **kwargs)
    tokens = windows.shape[0] * (windows.shape[1] - 1)
    nll = sums.sum().item() / tokens
    return {"nll": nll, "perplexity": math.exp(nll), "tokens": tokens,
            "window_nll": (sums / (windows.shape[1] - 1)).tolist()}


@torch.no_grad()
def strided_perplexity(model, token_ids: torch.Tensor, seq_len: int, stride: int, progress=None) -> dict:
    """Sliding windows of seq_len tokens moved by `stride`: every token after the first is scored
    once, with up to seq_len - 1 tokens of context (the overlap is context only)."""
    if not 0 < stride <= seq_len:
        raise ValueError(f"stride={stride} must be in 1..seq_len={seq_len}.")
    ids = token_ids.reshape(-1)
    device = next(model.parameters()).device
    nll_sum, tokens, scored_until = 0.0, 0, 1  # next unscored target position; token 0 has no context
    for begin in range(0, len(ids) - 1, stride):
        end = min(begin + seq_len, len(ids))
        window = ids[begin:end].to(device)[None]  # (1, L)
        logits = model(input_ids=window, use_cache=False).logits[0, :-1].float()  # (L-1, V)
        nll = F.cross_entropy(logits, window[0, 1:], reduction="none")  # (L-1,): target positions begin+1..end-1
        new = end - max(scored_until, begin + 1)  # targets not scored by an earlier window
        nll_sum += nll[-new:].double().sum().item()
        tokens += new
        scored_until = end
        if progress is not None:
            progress.update(1)
        if end == len(ids):
            break
    nll = nll_sum / tokens
    return {"nll": nll, "perplexity": math.exp(nll), "tokens": tokens}


def update_variants() -> dict:
    """The update rules compared by `hf-tangent eval`, by display name (None = unpatched)."""
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


UpdateName = Literal[tuple(update_variants())]  # the names above, as an option's type (its choices)


def evaluate_variants(model, windows: torch.Tensor, names: list[str] | None = None, *, batch_size: int = 1,
                      progress=None) -> list[dict]:
    """Held-out NLL/perplexity of the unpatched model and of each named update variant (applied to
    every layer, no training), with deltas against the unpatched row and each window's NLL
    ("window_nll"). The model is left unpatched."""
    if get_config(model) is not None:
        raise ValueError("evaluate_variants expects an unpatched model.")
    variants = update_variants()
    names = list(variants) if names is None else list(names)
    unknown = [n for n in names if n not in variants]
    if unknown:
        raise ValueError(f"unknown update variants {unknown}; accepted: {', '.join(variants)}.")
    if "unpatched" in names:
        names.remove("unpatched")
    rows = []
    for name in ["unpatched", *names]:
        if progress is not None:
            progress.set_postfix_str(name)
        if variants[name] is not None:
            patch(model, variants[name])
        try:
            result = perplexity(model, windows, batch_size=batch_size, progress=progress)
        finally:
            unpatch(model)
        rows.append({"variant": name, "config": None if variants[name] is None else variants[name].to_dict(),
                     "nll": result["nll"], "perplexity": result["perplexity"], "tokens": result["tokens"],
                     "window_nll": result["window_nll"]})
    for row in rows:
        row["delta_nll"] = row["nll"] - rows[0]["nll"]
        row["delta_perplexity"] = row["perplexity"] - rows[0]["perplexity"]
    return rows
