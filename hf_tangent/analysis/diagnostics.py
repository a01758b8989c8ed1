"""Per-layer diagnostics of what the FFN (and attention) do to residual directions, streamed.

Every quantity of docs/math.md section 4 is defined once, in `layer_quantities`. Hooks observe a
forward pass without changing anything (they return None): outputs stay bit-identical, and
`record()` removes every hook it added, also when the forward raises.

Points of a block with input h (per token):
    A   = attention output as added to the residual
    x   = what the pre-FFN norm reads: h + A on a sequential block, h on a parallel one
    y   = raw FFN output;  delta = what the layer adds for the FFN (y, or the patch's update)
    out = block output = h + A + delta
On a parallel block (GPT-NeoX use_parallel_residual, or a converted layer) "after attention" is
the virtual state h + A: the block never materialises it and its FFN reads h.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from ..core.discovery import architecture, first_output
from .evaluation import forward_windows

EPS = 1e-6
# name -> description; the order is the order of the records and plots
QUANTITIES = {
    "rho": "radial fraction |<x,y>| / (||x|| ||y|| + eps) of the raw FFN output",
    "orthogonality_error": "|<x,delta>| / (||x|| ||delta|| + eps) of the update the layer adds",
    "norm_x": "residual norm ||x|| at the FFN input",
    "norm_out": "residual norm ||out|| at the block output",
    "ffn_angle": "angular displacement arccos(<x, x + delta>) of the FFN step (radians)",
    "deficit": "attention-only angular deficit 1 - cos(P_u A, P_u (A + delta)), u = h / ||h||",
    "ffn_share": "FFN share <P_u delta, P_u (A+delta)> / ||P_u (A+delta)||^2 of the realized tangent update",
    "diversity_before_attention": "spherical diversity 1 - ||mean u||^2 of the block inputs of one sequence",
    "diversity_after_attention": "spherical diversity of h + A over one sequence",
    "diversity_after_ffn": "spherical diversity of the block outputs over one sequence",
}


def _dot(a, b):
    return (a * b).sum(-1)


def _unit(a):
    return a / (a.norm(dim=-1, keepdim=True) + EPS)


def diversity(points: torch.Tensor) -> torch.Tensor:
    """D = 1 - ||mean_i u_i||^2 over the token axis: (B, T, d) -> (B,)."""
    return 1.0 - _unit(points).mean(dim=-2).pow(2).sum(-1)


def tangent_part(v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """P_u v = v - <u, v> u for unit u."""
    return v - _dot(u, v)[..., None] * u


def layer_quantities(h, attn, x, y, delta, out) -> dict[str, torch.Tensor]:
    """All per-token (B, T) and per-sequence (B,) quantities of one layer, in float32."""
    h, attn, x, y, delta, out = (t.float() for t in (h, attn, x, y, delta, out))
    nx, ny, nd = x.norm(dim=-1), y.norm(dim=-1), delta.norm(dim=-1)
    x_next = x + delta
    cos_step = _dot(x, x_next) / (nx * x_next.norm(dim=-1) + EPS)
    u = _unit(h)
    tan_attn, tan_ffn = tangent_part(attn, u), tangent_part(delta, u)
    tan_block = tan_attn + tan_ffn
    cos_deficit = _dot(tan_attn, tan_block) / (tan_attn.norm(dim=-1) * tan_block.norm(dim=-1) + EPS)
    return {
        "rho": _dot(x, y).abs() / (nx * ny + EPS),
        "orthogonality_error": _dot(x, delta).abs() / (nx * nd + EPS),
        "norm_x": nx,
        "norm_out": out.norm(dim=-1),
        "ffn_angle": torch.arccos(cos_step.clamp(-1.0, 1.0)),
        "deficit": 1.0 - cos_deficit,
        "ffn_share": _dot(tan_ffn, tan_block) / (tan_block.pow(2).sum(-1) + EPS),
        "diversity_before_attention": diversity(h),
        "diversity_after_attention": diversity(h + attn),
        "diversity_after_ffn": diversity(out),
    }


class RunningStat:
    """Streaming mean/std (Chan/Welford merge, float64), min/max, and quantiles from a bounded
    reservoir sample (vectorised algorithm R): memory is O(reservoir_size), whatever the count."""

    def __init__(self, reservoir_size: int = 4096, seed: int = 0):
        self.reservoir_size = reservoir_size
        self.count, self.mean, self.m2 = 0, 0.0, 0.0
        self.min, self.max = math.inf, -math.inf
        self.reservoir = torch.empty(0, dtype=torch.float64)
        self.generator = torch.Generator().manual_seed(seed)

    def update(self, values: torch.Tensor) -> None:
        v = values.detach().reshape(-1).double().cpu()
        n = v.numel()
        if n == 0:
            return
        batch_mean = v.mean().item()
        batch_m2 = ((v - batch_mean) ** 2).sum().item()
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta * delta * self.count * n / total
        self.min, self.max = min(self.min, v.min().item()), max(self.max, v.max().item())
        room = self.reservoir_size - self.reservoir.numel()
        if room > 0:
            self.reservoir = torch.cat([self.reservoir, v[:room]])
        rest = v[max(room, 0):]
        if rest.numel():
            seen = torch.arange(self.count + max(room, 0) + 1, total + 1, dtype=torch.float64)  # 1-based index
            slot = (torch.rand(rest.numel(), generator=self.generator, dtype=torch.float64) * seen).long()
            keep = slot < self.reservoir_size
            self.reservoir[slot[keep]] = rest[keep]
        self.count = total

    def summary(self) -> dict:
        if self.count == 0:
            return {"count": 0}
        q = torch.quantile(self.reservoir, torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64)).tolist()
        return {"count": self.count, "mean": self.mean, "std": math.sqrt(self.m2 / self.count),
                "min": self.min, "max": self.max, "q05": q[0], "q50": q[1], "q95": q[2]}


class DiagnosticsRecorder:
    """Accumulates per-layer statistics while `record(model)` is active."""

    def __init__(self, num_layers: int, layers: list[int]):
        self.num_layers = num_layers
        self.layers = layers
        self.stats = {i: {name: RunningStat() for name in QUANTITIES} for i in layers}
        self.sequences = 0

    def update(self, index: int, quantities: dict[str, torch.Tensor]) -> None:
        for name, values in quantities.items():
            self.stats[index][name].update(values)

    def records(self) -> list[dict]:
        """One dict per observed layer: {"layer": i, name: {"mean", "std", ...}} plus norm drift."""
        out = []
        for i in self.layers:
            row = {"layer": i, **{name: self.stats[i][name].summary() for name in QUANTITIES}}
            row["norm_drift"] = (row["norm_out"]["mean"] / row["norm_x"]["mean"]
                                 if row["norm_x"].get("mean") else float("nan"))
            out.append(row)
        return out


@contextmanager
def record(model, layers: list[int] | None = None):
    """Context manager: `with record(model) as rec: model(ids)`, then `rec.records()`.

    Works on unpatched and patched models (any update rule, parallel blocks); never changes outputs.
    """
    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    spec, decoder = architecture(model)
    num_layers = len(decoder)
    chosen = list(range(num_layers)) if layers is None else list(layers)
    bad = [i for i in chosen if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"diagnostics: layer indices {bad} out of range; accepted: 0..{num_layers - 1}.")
    recorder = DiagnosticsRecorder(num_layers, chosen)
    handles = []
    try:
        for i in chosen:
            layer = decoder[i]
            seen: dict = {}

            def on_block_input(module, args, kwargs, seen=seen):
                seen["h"] = args[0] if args else kwargs["hidden_states"]

            def on_attention(module, args, output, seen=seen):
                seen["attn"] = first_output(output)

            def on_ffn_input(module, args, seen=seen):
                seen["x"] = args[0]

            def on_raw_ffn(module, args, output, seen=seen):
                seen["y"] = first_output(output)

            def on_added_ffn(module, args, output, seen=seen):
                seen["delta"] = first_output(output)

            def on_block_output(module, args, output, seen=seen, i=i):
                with torch.no_grad():
                    recorder.update(i, layer_quantities(seen["h"], seen["attn"], seen["x"], seen["y"],
                                                        seen["delta"], first_output(output)))
                seen.clear()

            ffn_out = spec.submodule(layer, "ffn_out")
            handles += [
                layer.register_forward_pre_hook(on_block_input, with_kwargs=True),
                spec.submodule(layer, "attention").register_forward_hook(on_attention),
                spec.submodule(layer, "ffn_norm").register_forward_pre_hook(on_ffn_input),  # after the patch's own
                ffn_out.register_forward_hook(on_raw_ffn, prepend=True),  # before the patch changes it
                ffn_out.register_forward_hook(on_added_ffn),
                layer.register_forward_hook(on_block_output),
            ]
        yield recorder
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def diagnose(model, windows: torch.Tensor, *, layers: list[int] | None = None, batch_size: int = 1,
             progress=None) -> list[dict]:
    """Per-layer records over token windows (n, T); the model's mode is left as it was."""
    if len(windows) == 0:
        raise ValueError("diagnostics: no windows to run on.")
    was_training = model.training
    model.eval()
    try:
        with record(model, layers) as recorder:
            for _ in forward_windows(model, windows, batch_size=batch_size, progress=progress):
                pass
    finally:
        model.train(was_training)
    return recorder.records()
