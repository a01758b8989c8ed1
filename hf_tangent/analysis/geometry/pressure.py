"""Aggregation pressure: every attention's logit scale times a factor, and the spherical diversity
before attention, after attention and after the FFN under it, per FFN variant."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ...core.discovery import architecture
from ..ablation import ablated
from ..diagnostics import record
from ..evaluation import forward_windows

ZERO_FACTOR = 1e-9  # attention_pressure's stand-in for 0


@contextmanager
def attention_pressure(model, factor: float):
    """Multiply every attention's logit scale by `factor` inside the block (0: a uniform average over
    the visible tokens, the most aggregation; 1: the model as it is), restored on exit. Uses the
    attention modules' `scaling`, which transformers passes to every attention implementation.
    Factor 0 is applied as 1e-9 (uniform to float32 precision): torch's causal SDPA returns NaN at
    scale 0."""
    if not (isinstance(factor, (int, float)) and not isinstance(factor, bool) and 0.0 <= factor):
        raise ValueError(f"attention pressure factor={factor!r}; accepted: a number >= 0.")
    spec, decoder = architecture(model)
    modules = []
    for i, layer in enumerate(decoder):
        attention = spec.submodule(layer, "attention")
        if not isinstance(getattr(attention, "scaling", None), (int, float)):
            raise ValueError(f"attention pressure: layer {i}'s {type(attention).__name__} has no numeric `scaling` "
                             "attribute, so its logit scale cannot be changed; accepted: attention modules that pass "
                             "`scaling=self.scaling` to the attention interface (Llama, Mistral, GPT-NeoX, GPT-2 in "
                             "transformers 5).")
        modules.append((attention, attention.scaling))
    try:
        for attention, scaling in modules:
            attention.scaling = scaling * max(factor, ZERO_FACTOR)
        yield model
    finally:
        for attention, scaling in modules:
            attention.scaling = scaling


@torch.no_grad()
def pressure_diversity(model, windows: torch.Tensor, factors, variants, *, layers=None, progress=None) -> list[dict]:
    """Spherical diversity D before attention, after attention and after the FFN, per layer, for
    every (pressure factor, FFN variant): one forward per window each."""
    was_training = model.training
    model.eval()
    rows = []
    try:
        reference = model(input_ids=windows[:1].to(next(model.parameters()).device), use_cache=False).logits
        for factor in factors:
            with attention_pressure(model, factor):
                if factor != 1:
                    changed = model(input_ids=windows[:1].to(reference.device), use_cache=False).logits
                    if not torch.isfinite(changed).all():
                        raise RuntimeError(f"attention pressure: factor {factor} gave non-finite logits.")
                    if torch.equal(changed, reference):
                        raise RuntimeError("attention pressure: changing the attention modules' `scaling` did not "
                                           "change the output; this attention implementation ignores it.")
                for variant in variants:
                    with ablated(model, variant), record(model, layers) as recorder:
                        for _ in forward_windows(model, windows):
                            pass
                    for r in recorder.records():
                        rows.append({"factor": factor, "variant": variant, "layer": r["layer"],
                                     **{k: r[f"diversity_{k}"]["mean"] for k in
                                        ("before_attention", "after_attention", "after_ffn")}})
            if progress is not None:
                progress.update(1)
    finally:
        model.train(was_training)
    return rows
