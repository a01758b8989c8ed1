"""The reduced fields of a real layer (F_A, F_Phi, F), replayed through the layer's own forward,
seeded samples of real token directions, and the critical directions of every field of a layer."""

from __future__ import annotations

import torch
from torch import nn

from ..patching import get_config
from ..registry import architecture, first_output
from .sphere import LABELS, analyse_critical, find_critical, unit

FIELDS = ("attention", "ffn", "full")


class LayerFields:
    """F_A, F_Phi and F of decoder layer `index` of an unpatched model, as row-wise maps (N, d) -> (N, d)."""

    def __init__(self, model, index: int):
        if get_config(model) is not None:
            raise ValueError("geometry: measure the reduced fields on the unpatched model (hf_tangent.unpatch first).")
        self.model = model
        self.spec, decoder = architecture(model)
        if not 0 <= index < len(decoder):
            raise ValueError(f"geometry: layer {index} out of range; accepted: 0..{len(decoder) - 1}.")
        self.index, self.layer = index, decoder[index]
        self.attention_out = self.spec.submodule(self.layer, "attention_out")
        self.ffn_branch = self.spec.ffn_branch(self.layer)
        self.scale = self.spec.scale(self.layer)
        self.param = next(model.parameters())
        self._args, self._kwargs = self._layer_call()

    def _layer_call(self):
        """The layer's arguments in a one-token forward (position embeddings, masks), to replay."""
        seen = {}

        def grab(module, args, kwargs):
            seen["args"], seen["kwargs"] = args, kwargs
            raise _Captured

        handle = self.layer.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            with torch.no_grad():
                self.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.param.device), use_cache=False)
        except _Captured:
            pass
        finally:
            handle.remove()
        if "args" not in seen:
            raise RuntimeError(f"geometry: layer {self.index} was not called in a forward pass.")
        dropped = ("hidden_states", "past_key_values", "past_key_value", "layer_past")
        kwargs = {k: v for k, v in seen["kwargs"].items() if k not in dropped}
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
        return seen["args"][1:], kwargs

    def attention(self, u: torch.Tensor) -> torch.Tensor:
        seen = {}

        def grab(module, args, output):
            seen["a"] = first_output(output)

        handle = self.attention_out.register_forward_hook(grab)
        try:
            self.layer(u.to(self.param.dtype)[:, None, :], *self._args, **self._kwargs)
        finally:
            handle.remove()
        return seen["a"][:, 0, :].float()

    def ffn(self, u: torch.Tensor) -> torch.Tensor:
        return self.scale * self.ffn_branch(u.to(self.param.dtype)).float()

    def full(self, u: torch.Tensor) -> torch.Tensor:
        return self.attention(u) + self.ffn(u)

    def field(self, name: str):
        if name not in FIELDS:
            raise ValueError(f"geometry: unknown field {name!r}; accepted: {', '.join(FIELDS)}.")
        return getattr(self, name)


class _Captured(Exception):
    pass


@torch.no_grad()
def _sample_inputs(model, windows, modules: dict[int, nn.Module], per_layer: int, seed: int) -> dict[int, torch.Tensor]:
    """A seeded uniform sample of `per_layer` rows of what each module receives over the windows,
    position 0 excluded (the attention sink); only the sample is kept."""
    g = torch.Generator().manual_seed(seed)
    kept = {i: RunningSample(per_layer, g) for i in modules}

    def hook(i):
        def grab(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            kept[i].add(h[:, 1:].reshape(-1, h.shape[-1]).float().cpu())
        return grab

    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in modules.items()]
    try:
        device = next(model.parameters()).device
        for w in windows:
            model(input_ids=w[None].to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {i: kept[i].rows() for i in modules}


def block_inputs(model, windows: torch.Tensor, layers: list[int], per_layer: int, seed: int = 0) -> dict[int, torch.Tensor]:
    """Real token directions at each layer's block input, (per_layer, d) unit rows."""
    _, decoder = architecture(model)
    return {i: unit(x) for i, x in _sample_inputs(model, windows, {i: decoder[i] for i in layers}, per_layer,
                                                  seed).items()}


def ffn_inputs(model, windows: torch.Tensor, layers: list[int], per_layer: int, seed: int = 0) -> dict[int, torch.Tensor]:
    """Real FFN inputs x (what the pre-FFN norm reads) per layer, (per_layer, d)."""
    spec, decoder = architecture(model)
    return _sample_inputs(model, windows, {i: spec.submodule(decoder[i], "ffn_norm") for i in layers}, per_layer, seed)


def critical_directions(model, index: int, token_starts: torch.Tensor, *, random_starts: int = 32,
                        fields=FIELDS, steps: int = 300, lr: float = 0.05, threshold: float = 0.05,
                        rel_tol: float = 1e-2, seed: int = 0) -> dict:
    """Critical-direction candidates of each reduced field of layer `index`, from `random_starts`
    Gaussian directions and the rows of `token_starts`, with their tangent-Jacobian spectra and
    labels; at the full field's candidates, the decomposition error ||J - J_A - J_Phi|| / ||J||."""
    fields_of = LayerFields(model, index)
    d = fields_of.param.shape[-1] if token_starts.numel() == 0 else token_starts.shape[-1]
    g = torch.Generator().manual_seed(seed * 1000 + index)
    starts = torch.cat([torch.randn(random_starts, d, generator=g), token_starts.float().cpu()]).to(fields_of.param.device)
    out = {"layer": index, "fields": {}}
    for name in fields:
        fn = fields_of.field(name)
        found = find_critical(fn, starts, steps=steps, lr=lr, threshold=threshold)
        candidates = analyse_critical(fn, found["directions"], rel_tol)
        if name == "full" and candidates:
            parts = {p: analyse_critical(fields_of.field(p), found["directions"], rel_tol) for p in ("attention", "ffn")}
            for k, c in enumerate(candidates):
                combined = parts["attention"][k]["jacobian"] + parts["ffn"][k]["jacobian"]
                c["decomposition_error"] = ((c["jacobian"] - combined).norm() / c["jacobian"].norm()).item()
        out["fields"][name] = {
            "starts": found["starts"], "converged": found["converged"], "candidates": [
                {"score": found["scores"][k].item(), **{key: v for key, v in c.items() if key not in ("jacobian",)},
                 "eigenvalues": [[z.real, z.imag] for z in c["eigenvalues"].tolist()]}
                for k, c in enumerate(candidates)],
            "directions": found["directions"].cpu()}
    return out


def label_counts(candidates: list[dict]) -> dict:
    counts = {label: 0 for label in LABELS}
    for c in candidates:
        counts[c["label"]] += 1
    return counts


class RunningSample:
    """A uniform sample of at most `size` rows from a stream (reservoir, seeded)."""

    def __init__(self, size: int, generator: torch.Generator):
        self.size, self.generator, self.seen, self.kept = size, generator, 0, []

    def add(self, rows: torch.Tensor) -> None:
        for row in rows:
            self.seen += 1
            if len(self.kept) < self.size:
                self.kept.append(row.clone())
            else:
                slot = int(torch.randint(self.seen, (1,), generator=self.generator))
                if slot < self.size:
                    self.kept[slot] = row.clone()

    def rows(self) -> torch.Tensor:
        return torch.stack(self.kept)
