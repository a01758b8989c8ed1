"""Opt-in fused execution of a parallel-residual layer (`TangentConfig(parallel_execution="fused")`).

In a converted layer attention and FFN read the same block input h, so their input projections can
run as one GEMM (GPT-J / PaLM style) after one shared normalisation: with RMSNorm weights w1
(attention) and w2 (FFN) folded into the weights,

    [q; k; v; gate; up] = [Wq diag(w1); Wk diag(w1); Wv diag(w1); Wg diag(w2); Wu diag(w2)] (h / rms(h))

This is the one place where hf_tangent replaces computation: the `forward` of the input
projections of a converted layer is replaced on those module instances (each returns its slice of
the fused GEMM), and a hook on each of the two norms hands h on instead of the normed h. The norms
are hooked, not replaced: transformers' kernel layers (`kernelize`, run by `from_pretrained` and by
every change between train and eval mode) put back the `forward` of norm instances. A layer call
whose projections did not all take their slice raises, rather than mixing fused and unfused
projections. The layer's own forward still runs, so the KV cache, gradient checkpointing and
output_hidden_states work as before; weights and state-dict keys are untouched, and the fused weight
is re-concatenated whenever a weight changes (or on every call while gradients flow, so training
updates the original weights).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from .calls import call_key


class FusedParallelExecution:
    """Fused projections of one converted layer; `install` / `uninstall` on the layer's modules."""

    def __init__(self, spec, layer: nn.Module):
        if not spec.fused_attention_in or not spec.fused_ffn_in:
            raise ValueError(
                f"hf_tangent: model_type '{spec.model_type}' has no fused parallel execution path "
                "(needs RMSNorm and separate attention/FFN input projections, as llama, mistral, qwen2); "
                "use parallel_execution='hooks'."
            )
        self.norms = (spec.submodule(layer, "input_norm"), spec.submodule(layer, "ffn_norm"))
        eps = {getattr(n, "variance_epsilon", getattr(n, "eps", None)) for n in self.norms}
        if len(eps) != 1 or None in eps or not all(hasattr(n, "weight") for n in self.norms):
            raise ValueError("hf_tangent: fused parallel execution needs two RMSNorms with the same epsilon.")
        self.eps = eps.pop()
        self.paths = list(spec.fused_attention_in) + list(spec.fused_ffn_in)
        self.attention_in = [layer.get_submodule(p) for p in spec.fused_attention_in]
        self.ffn_in = [layer.get_submodule(p) for p in spec.fused_ffn_in]
        if not all(isinstance(m, nn.Linear) for m in self.attention_in + self.ffn_in):
            raise ValueError("hf_tangent: fused parallel execution needs nn.Linear input projections "
                             "(apply PEFT after the patch, not before).")
        self.layer = layer
        self._count = len(self.attention_in) + len(self.ffn_in)  # projections per layer call
        self._outputs: dict[int, tuple] = {}  # call_key() -> (h, its projections, indices not yet read)
        self._cache_key = None
        self._weight = self._bias = None

    # the fused weight, with the norm weights folded in
    def _fused_weight(self):
        w1, w2 = (n.weight for n in self.norms)
        tensors = [p for m in self.attention_in + self.ffn_in for p in (m.weight, m.bias) if p is not None] + [w1, w2]
        key = tuple((id(t), t._version) for t in tensors)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            key = None  # build it in the graph: gradients reach the original weights
        if key is None or key != self._cache_key:
            weight = torch.cat([m.weight * w1 for m in self.attention_in] + [m.weight * w2 for m in self.ffn_in])
            biases = [m.bias if m.bias is not None else m.weight.new_zeros(m.out_features)
                      for m in self.attention_in + self.ffn_in]
            bias = torch.cat(biases) if any(m.bias is not None for m in self.attention_in + self.ffn_in) else None
            if key is None:
                return weight, bias
            self._cache_key, self._weight, self._bias = key, weight.detach(), None if bias is None else bias.detach()
        return self._weight, self._bias

    def _projections(self, h):
        """All five projections of the block input h, (B, T, q + k + v + gate + up): one GEMM."""
        hf = h.float()
        normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + self.eps)).to(h.dtype)  # (B, T, d)
        weight, bias = self._fused_weight()
        sizes = [m.out_features for m in self.attention_in + self.ffn_in]
        return list(torch.split(F.linear(normed, weight, bias), sizes, dim=-1))

    def _slice(self, index, h):
        """Projection `index` of h. The first projection of a layer call computes all of them (the norms
        hand h on, so every projection receives the same tensor); the last one drops them (the entry stays,
        empty, for `release`), so a checkpointed recomputation computes them again."""
        key = call_key()
        entry = self._outputs.get(key)
        if entry is None or entry[0] is not h:
            entry = self._outputs[key] = [h, self._projections(h), set(range(self._count))]
        entry[2].discard(index)
        out = entry[1][index]
        if not entry[2]:
            entry[0] = entry[1] = None
        return out

    def release(self, key: int) -> bool:
        """Drop a call's outputs (called when the layer returns); False when its projections did not all
        take their slice (one of them no longer runs `_slice`: its forward was replaced again)."""
        entry = self._outputs.pop(key, None)
        return entry is not None and not entry[2]

    def _hand_on_input(self, module, args, kwargs, output):
        return args[0] if args else next(iter(kwargs.values()))

    def in_place(self) -> bool:
        """True while every input projection still sits where the patch found it (not wrapped since)."""
        return all(self.layer.get_submodule(p) is m for p, m in zip(self.paths, self.attention_in + self.ffn_in, strict=True))

    def install(self) -> None:
        for i, module in enumerate(self.attention_in + self.ffn_in):
            module.forward = functools.partial(self._slice, i)  # a partial deep-copies with the model
        for norm in self.norms:
            norm.register_forward_hook(self._hand_on_input, with_kwargs=True)

    def uninstall(self) -> None:
        for module in self.attention_in + self.ffn_in:
            vars(module).pop("forward", None)
        for norm in self.norms:
            for key in [k for k, fn in norm._forward_hooks.items() if getattr(fn, "__self__", None) is self]:
                del norm._forward_hooks[key]
                norm._forward_hooks_with_kwargs.pop(key, None)
        self._outputs = {}
