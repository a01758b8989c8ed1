"""The reduced fields of a real layer (F_A, F_Phi, F), replayed through the layer's own forward,
seeded samples of real token directions, and the critical directions of every field of a layer."""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from ...core.discovery import architecture, ffn_branch, first_output
from ...core.patching import get_config
from .sphere import unit

FIELDS = ("attention", "ffn", "full")  # the reduced fields of a layer (critical.py)


class LayerFields:
    """F_A, F_Phi and F of decoder layer `index` of an unpatched model, as row-wise maps (N, d) -> (N, d).

    `dtype=torch.float64` evaluates them on a float64 copy of the layer (the model is untouched): the
    precision that root refinement to a zero score of 1e-8 needs; the default is the model's dtype."""

    def __init__(self, model, index: int, dtype: torch.dtype | None = None):
        if get_config(model) is not None:
            raise ValueError("geometry: measure the reduced fields on the unpatched model (hf_tangent.unpatch first).")
        self.model = model
        self.spec, decoder = architecture(model)
        if not 0 <= index < len(decoder):
            raise ValueError(f"geometry: layer {index} out of range; accepted: 0..{len(decoder) - 1}.")
        self.index, self.param = index, next(model.parameters())
        self.dtype = dtype or self.param.dtype
        self._args, self._kwargs = self._layer_call(decoder[index])
        self.layer = decoder[index] if self.dtype == self.param.dtype else copy.deepcopy(decoder[index]).to(self.dtype)
        if self.layer is not decoder[index]:  # the captured arguments (rotary cos/sin, masks) follow the copy
            self._args, self._kwargs = tree_map(self._cast, self._args), tree_map(self._cast, self._kwargs)
        self.attention_out = self.spec.submodule(self.layer, "attention_out")
        self.ffn_branch = ffn_branch(self.spec, self.layer)
        self.scale = self.spec.scale(self.layer)

    def _cast(self, value):
        return value.to(self.dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    def _layer_call(self, layer):
        """The layer's arguments in a one-token forward (position embeddings, masks), to replay."""
        seen = {}

        def grab(module, args, kwargs):
            seen["args"], seen["kwargs"] = args, kwargs
            raise _Captured

        handle = layer.register_forward_pre_hook(grab, with_kwargs=True)
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
            with self._precision():
                self.layer(u.to(self.dtype)[:, None, :], *self._args, **self._kwargs)
        finally:
            handle.remove()
        return seen["a"][:, 0, :].to(self._out_dtype)

    def ffn(self, u: torch.Tensor) -> torch.Tensor:
        with self._precision():
            return self.scale * self.ffn_branch(u.to(self.dtype)).to(self._out_dtype)

    def _precision(self):
        return _StayInFloat64() if self.dtype == torch.float64 else contextlib.nullcontext()

    @property
    def _out_dtype(self) -> torch.dtype:
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    def full(self, u: torch.Tensor) -> torch.Tensor:
        return self.attention(u) + self.ffn(u)

    def field(self, name: str):
        if name not in FIELDS:
            raise ValueError(f"geometry: unknown field {name!r}; accepted: {', '.join(FIELDS)}.")
        return getattr(self, name)


class _Captured(Exception):
    pass


class _StayInFloat64(TorchFunctionMode):
    """Inside the float64 replay, casts down to float32 stay float64: norms compute their statistics
    in float32 by design (`x.to(torch.float32)`), which would cap the fields' precision at ~1e-7 and
    with it how far a root can be refined. Nothing of the layer's code is copied."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float and args[0].dtype == torch.float64:
            return args[0]
        if func is torch.Tensor.to and args[0].dtype == torch.float64:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)


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
