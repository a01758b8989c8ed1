"""Opt-in fused execution of a parallel-residual layer (`TangentConfig(parallel_execution="fused")`).

In a converted layer attention and FFN read the same block input h, so h is normalised once and each
branch's input projections run as one GEMM (GPT-J / PaLM style): with n = h / rms(h) and the RMSNorm
weights w1 (attention) and w2 (FFN),

    [q; k; v] = [Wq; Wk; Wv] (w1 * n)        [gate; up] = [Wg; Wu] (w2 * n)

The unconverted layer runs two norms and five GEMMs; this runs one normalisation and two GEMMs, and
no op twice. The norm weights are applied to n, not folded into the GEMM weights: a folded weight is
derived data, which goes stale when a weight changes; here each projection's weight *is* its rows of
the stacked matrix (a view, made at patch time), so an optimizer step, `load_state_dict` or any
in-place change is the stacked matrix's change. What replaces parameters is followed: `.to()` stacks
and links the converted ones at once; a copy (deepcopy, pickle) or a load that assigns parameters
(from_pretrained, `load_state_dict(assign=True)`) on its next eager call. While gradients flow, or
while a parameter is not the linked one or not in its storage (torch.func.functional_call, offloading
hooks, FSDP or ZeRO-3 swapping `.data`: checked per call by identity and data pointer), the GEMM
reads `cat` of the live parameters in the graph: right (gradients reach them), only slower.

Modules are class-swapped, never given an instance `forward` (transformers' `kernelize`, run by
`from_pretrained` and by every switch between train and eval mode, puts back instance forwards; a
swapped norm also opts out of kernelize): the two norms become `FusedParallel<Norm>`, whose forward
returns the GEMM of its branch (the FFN norm is fed h by TangentLayer's pre-hook and reuses the input
norm's n for that same tensor), and the projections become `FusedProjection`, which return their
slice of it. Weights, state-dict keys and the layer's own forward (KV cache, gradient checkpointing,
output_hidden_states) stay; `uninstall` puts classes, forwards and separate weight storage back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_ATTRS = ("_fused_parallel", "_fused_group", "_fused_last", "_fused_sites", "_fused_rows")


class _Group:
    """The input projections of one branch; `weight` = [W_1; ...; W_k] (out, in) whose row blocks are their
    weights (bias likewise), or None until linked."""

    def __init__(self, modules, owner: str):
        self.modules, self.owner = tuple(modules), owner  # owner: the layer's class name, for messages
        sizes = [m.out_features for m in self.modules]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.rows = tuple(slice(a, a + s) for a, s in zip(starts, sizes, strict=True))
        self.weight = self.bias = None
        self.checks = ()  # (module._parameters, name, linked parameter, its rows of the stack) per weight and bias

    def __getstate__(self):  # a copy (deepcopy, pickle) has new parameters: it links them on its first call
        return {**vars(self), "weight": None, "bias": None, "checks": ()}

    def _params(self):
        return [(m._parameters, name, m._parameters[name]) for m in self.modules for name in ("weight", "bias")
                if m._parameters.get(name) is not None]

    def linkable(self) -> bool:
        """Parameters of one dtype and device, plain tensors (not DTensor, nor what functional_call put there)."""
        params = [p for _, _, p in self._params()]
        return len({(p.dtype, p.device) for p in params}) == 1 and \
            all(isinstance(p, nn.Parameter) and type(p.detach()) is torch.Tensor for p in params)

    def link(self) -> None:
        """Stack the projections' weights (and biases) and make each its rows of the stack (`.data`)."""
        params = self._params()
        with torch.no_grad(), torch.inference_mode(False):
            weight = torch.cat([m.weight.detach() for m in self.modules])  # (sum of out_features, in)
            biased = [m for m in self.modules if m.bias is not None]
            bias = torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features)
                              for m in self.modules]) if biased else None
            for m, rows in zip(self.modules, self.rows, strict=True):
                m.weight.data = weight[rows]
                if m.bias is not None:
                    m.bias.data = bias[rows]
        self.weight, self.bias = weight, bias
        self.checks = tuple((params, name, p, p.detach()) for params, name, p in params)

    def unlink(self) -> None:
        """Give every projection weight storage of its own again (values unchanged)."""
        with torch.no_grad(), torch.inference_mode(False):
            for _, _, p in self._params():
                p.data = p.detach().clone()
        self.weight = self.bias = None
        self.checks = ()

    def current(self):
        """(weight, bias) of a call the linked stack cannot serve (the slow path): link first if the stack was
        dropped; `cat` of the live parameters while gradients flow or a parameter is not the linked one."""
        if self.weight is None and not torch.compiler.is_compiling():
            kinds = {(p.dtype, p.device) for _, _, p in self._params()}
            if len(kinds) != 1:
                raise RuntimeError(
                    f"hf_tangent: the input projections of a parallel_execution='fused' layer of {self.owner} have "
                    f"different dtypes or devices {sorted(map(str, kinds))}; accepted: one dtype and one device per "
                    "layer (convert the whole layer with .to()).")
            if self.linkable():
                self.link()
                if not (torch.is_grad_enabled() and any(p.requires_grad for _, _, p, _ in self.checks)):
                    return self.weight, self.bias
        weight = torch.cat([m.weight for m in self.modules])
        if all(m.bias is None for m in self.modules):
            return weight, None
        return weight, torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features)
                                  for m in self.modules])


class _SharedNorm(nn.Module):
    """The two RMSNorms of a fused converted layer (mixed into their own class, see `_norm_class`)."""

    kernel_condition = staticmethod(lambda module: False)  # kernelize leaves this forward alone

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h (B, T, d) -> its branch's projections (B, T, sum of their out_features). Per call: identity tests and
        dict lookups only (is every projection where the patch found it, is the stack linked and without grad)."""
        for modules, name, module in self._fused_sites:
            if modules.get(name) is not module:
                raise RuntimeError(
                    f"hf_tangent: '{name}' of a layer converted with parallel_execution='fused' was replaced since the "
                    f"patch (now {type(modules.get(name)).__name__}; an adapter such as PEFT's LoRA wraps it), so it "
                    "would read the fused GEMM's output instead of the normalised block input. Use "
                    "parallel_execution='hooks' with adapters, or patch again (hf_tangent.patch) after changing the layer."
                )
        fp = self._fused_parallel
        pending = fp.pending  # (h, n) of the input norm: the FFN norm is fed the same h
        if pending is not None and pending[0] is h:
            n = pending[1]
        else:
            hf = h.float()
            n = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + fp.eps)).to(h.dtype)  # (B, T, d)
        fp.pending = None if self._fused_last else (h, n)
        group = self._fused_group
        weight, bias = group.weight, group.bias
        grad, eager = torch.is_grad_enabled(), not torch.compiler.is_dynamo_compiling()
        for params, name, p, rows in group.checks:  # empty while not linked (weight is None); dynamo: no data pointers
            if params[name] is not p or (grad and p.requires_grad) or (eager and p.data_ptr() != rows.data_ptr()):
                weight = None
                break
        if weight is None:
            weight, bias = group.current()
        return F.linear(self._parameters["weight"] * n, weight, bias)

    def __reduce_ex__(self, protocol):  # pickle and deepcopy rebuild the swapped class from the original one
        return _new_norm, (self._fused_original,), self.__dict__


class FusedProjection(nn.Linear):
    """An input projection of a fused converted layer: its rows of the GEMM its norm ran."""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z[..., self._fused_rows]

    def _apply(self, fn, recurse=True):  # .to(), .half(), ...: new tensors, not views of the stack
        super()._apply(fn, recurse)
        group = self._fused_group
        group.weight = None
        if group.linkable():  # the branch's last projection is converted: stack them now, not in a (compiled) call
            group.link()
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """Saved as tensors of their own: the live weights are views of the stacked weight, and savers that drop
        tensors sharing a storage (safetensors' save_model, accelerate's save_model) would drop them."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not keep_vars:
            for name in ("weight", "bias"):
                if destination.get(prefix + name) is not None:
                    destination[prefix + name] = destination[prefix + name].clone()

    def register_parameter(self, name, param):  # setattr: from_pretrained's loading, load_state_dict(assign=True):
        super().register_parameter(name, param)  # linked on the next call, once (not per parameter loaded)
        self._fused_group.weight = None


_NORM_CLASSES: dict[type, type] = {}


def _norm_class(cls: type) -> type:
    if cls not in _NORM_CLASSES:
        _NORM_CLASSES[cls] = type(f"FusedParallel{cls.__name__}", (_SharedNorm, cls),
                                  {"_fused_original": cls, "__module__": __name__})
    return _NORM_CLASSES[cls]


def _new_norm(cls: type) -> nn.Module:
    return nn.Module.__new__(_norm_class(cls))


def _original(module: nn.Module) -> type:
    return getattr(type(module), "_fused_original", nn.Linear if isinstance(module, FusedProjection) else type(module))


class FusedParallelExecution:
    """Fused execution of one converted layer; `install` / `uninstall` on the layer's modules."""

    def __init__(self, spec, layer: nn.Module):
        if not spec.fused_attention_in or not spec.fused_ffn_in:
            raise ValueError(
                f"hf_tangent: model_type '{spec.model_type}' has no fused parallel execution path "
                "(needs RMSNorm and separate attention/FFN input projections, as llama, mistral, qwen2); "
                "use parallel_execution='hooks'."
            )
        self.norms = (spec.submodule(layer, "input_norm"), spec.submodule(layer, "ffn_norm"))
        eps = {getattr(n, "variance_epsilon", getattr(n, "eps", None)) for n in self.norms}
        if len(eps) != 1 or None in eps or not all(isinstance(n._parameters.get("weight"), nn.Parameter)
                                                   and n._parameters.get("bias") is None for n in self.norms):
            raise ValueError("hf_tangent: fused parallel execution needs two RMSNorms (a weight, no bias) with the "
                             "same epsilon.")
        self.eps = eps.pop()
        groups = [[layer.get_submodule(p) for p in paths] for paths in (spec.fused_attention_in, spec.fused_ffn_in)]
        d = self.norms[0].weight.shape[-1]
        if not all(_original(m) is nn.Linear and m.in_features == d and m.weight.is_floating_point()
                   for group in groups for m in group):
            raise ValueError(f"hf_tangent: fused parallel execution needs plain floating-point nn.Linear input projections "
                             f"reading the hidden size {d} (apply PEFT or quantisation after the patch, not before; "
                             "or use parallel_execution='hooks').")
        for norm in self.norms:
            _check_rms_norm(norm, self.eps)
        self.groups = tuple(_Group(modules, type(layer).__name__) for modules in groups)
        if not all(group.linkable() for group in self.groups):
            raise ValueError("hf_tangent: fused parallel execution needs each branch's input projections in one dtype "
                             "on one device, as plain parameters (patch before sharding); or use "
                             "parallel_execution='hooks'.")
        # per norm: (parent's _modules, name, module) from the layer down to each projection of its branch
        self.sites = tuple(_sites(layer, paths) for paths in (spec.fused_attention_in, spec.fused_ffn_in))
        self.pending = None  # (h, h / rms(h)) from the input norm to the FFN norm, within one layer call
        self._forwards: dict[int, object] = {}  # instance forwards the norms had (kernelize's), put back on uninstall

    def install(self) -> None:
        for i, (norm, group, sites) in enumerate(zip(self.norms, self.groups, self.sites, strict=True)):
            forward = vars(norm).pop("forward", None)
            if forward is not None:
                self._forwards[i] = forward
            norm.__class__ = _norm_class(_original(norm))
            vars(norm).update(_fused_parallel=self, _fused_group=group, _fused_last=i == 1, _fused_sites=sites)
            for module, rows in zip(group.modules, group.rows, strict=True):
                module.__class__ = FusedProjection
                vars(module).update(_fused_group=group, _fused_rows=rows)
            group.link()

    def uninstall(self) -> None:
        for i, (norm, group) in enumerate(zip(self.norms, self.groups, strict=True)):
            norm.__class__ = _original(norm)
            for module in (norm, *group.modules):
                for attr in _ATTRS:
                    vars(module).pop(attr, None)
            if i in self._forwards:
                norm.forward = self._forwards.pop(i)
            for module in group.modules:
                module.__class__ = nn.Linear
            group.unlink()
        self.pending = None

    def linked(self) -> bool:
        """True when the next call without gradients reads the linked stacks (the fast path)."""
        return all(g.weight is not None and all(params[name] is p and p.data_ptr() == rows.data_ptr()
                                                for params, name, p, rows in g.checks) for g in self.groups)


def _sites(layer: nn.Module, paths) -> tuple:
    """(parent's _modules, name, module) for every step from the layer down to each of `paths`, once each."""
    sites = {}
    for path in paths:
        parent = layer
        for name in path.split("."):
            sites.setdefault((id(parent), name), (parent._modules, name, parent._modules[name]))
            parent = parent._modules[name]
    return tuple(sites.values())


def _check_rms_norm(norm: nn.Module, eps: float) -> None:
    """The swapped forward computes w * (h / rms(h)); refuse a norm class that computes something else."""
    w = norm.weight
    if w.is_meta:  # not loaded yet (from_pretrained): nothing to probe
        return
    h = torch.randn(2, w.shape[-1], generator=torch.Generator().manual_seed(0)).to(w)
    with torch.no_grad():
        hf = h.float()
        expected = w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
        if not torch.equal(_original(norm).forward(norm, h), expected):
            raise ValueError(f"hf_tangent: fused parallel execution computes w * h / rms(h) for {type(norm).__name__}, "
                             "whose forward computes something else; use parallel_execution='hooks'.")
