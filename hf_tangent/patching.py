"""Patching mechanics: `patch`, `unpatch`, `get_config`.

A layer's forward is never replaced. Each selected decoder layer gets a child module
`tangent_patch` (a `TangentLayer`) whose hooks sit on the layer's own submodules:

    input_norm  pre-hook   remember the block input            (parallel conversion only)
    ffn_norm    pre-hook   remember x; feed the block input    (parallel conversion only)
    ffn_out     hook       return x_next - x, so the layer's own `residual + out` is x_next

The gate (if any) is a parameter of that child, which is called in forward (DeepSpeed ZeRO-3
gathers it). `unpatch` removes exactly these hooks and children: outputs are bit-identical again.
The one exception to "hooks only" is the opt-in fused parallel execution (fused_parallel.py).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from .config import NOISE_UPDATES, TangentConfig
from .fused import fused_residual_delta
from .fused_parallel import FusedParallelExecution
from .registry import ArchitectureSpec, get_spec
from .rules import noise_delta, residual_delta

CHILD_NAME = "tangent_patch"
CONFIG_KEY = "hf_tangent"  # the patch's record in model.config / config.json
_MODEL_ATTR = "_hf_tangent_config"


class TangentLayer(nn.Module):
    """The patch of one decoder layer: its update rule, optional FFN gate, and hook callbacks."""

    def __init__(self, config: TangentConfig, index: int, *, update: bool, parallel: bool):
        super().__init__()
        self.config = config
        self.index = index
        self.parallel = parallel
        gated = update and config.gates
        self.gate = nn.Parameter(torch.ones((), dtype=torch.float32)) if gated else None
        # An 'add' update without alpha or gate is the model's own add: no hook needed.
        self.applies_update = update and (config.update != "add" or config.alpha != 1.0 or gated)
        self._x = None
        self._block_input = None
        self._attention_x = None
        self.attention_branch = update and "attention" in config.branches and config.update != "add"
        self.fused_execution = None  # FusedParallelExecution when parallel_execution="fused"

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x_next - x in y's dtype (float32 arithmetic inside)."""
        c = self.config
        if c.update in NOISE_UPDATES:
            return noise_delta(x, y, c.update, alpha=c.alpha, gamma=c.gamma, h=c.noise_h, rank=c.noise_rank,
                               training=self.training, gate=self.gate)
        delta = fused_residual_delta if c.implementation == "fused" else residual_delta
        return delta(x, y, c.update, alpha=c.alpha, beta=c.beta, p=c.p, eps=c.eps, eps_mode=c.eps_mode, gate=self.gate)

    def extra_repr(self) -> str:
        c = self.config
        rule = c.update if self.applies_update else "add"
        extra = {"soft": f", beta={c.beta}", "retract": f", p={c.p}"}.get(rule, "")
        return f"layer={self.index}, update={rule}{extra}, alpha={c.alpha}, gate={self.gate is not None}, parallel={self.parallel}"

    # --- hook callbacks (bound methods, so unpatch can find them and deepcopy rebinds them)
    def _record_block_input(self, module, args, kwargs):
        self._block_input = args[0] if args else next(iter(kwargs.values()))
        self._attention_x = self._block_input

    def _apply_attention_update(self, module, args, output):
        """The rule on the attention branch (branches includes 'attention'): x = the block input."""
        x, self._attention_x = self._attention_x, None
        if x is None:
            return None
        if isinstance(output, tuple):
            return (self(x, output[0]),) + tuple(output[1:])
        return self(x, output)

    def _record_x(self, module, args, kwargs):
        if self.parallel and self._block_input is not None:
            x, self._block_input = self._block_input, None
            if self.applies_update:
                self._x = x
            return ((x,) + tuple(args[1:]), kwargs) if args else ((x,), {})
        # sequential, or the norm called on its own outside the layer's forward: inputs unchanged
        if self.applies_update:
            self._x = args[0] if args else next(iter(kwargs.values()))
        return None

    def _apply_update(self, module, args, output):
        x, self._x = self._x, None
        if x is None:  # the FFN called on its own, outside the layer's forward: leave it alone
            return None
        if isinstance(output, tuple):
            return (self(x, output[0]),) + tuple(output[1:])
        return self(x, output)

    def install(self, spec: ArchitectureSpec, layer: nn.Module) -> None:
        if self.parallel and self.config.parallel_execution == "fused":
            self.fused_execution = FusedParallelExecution(spec, layer)
            self.fused_execution.install()
        if self.parallel or self.attention_branch:
            spec.submodule(layer, "input_norm").register_forward_pre_hook(self._record_block_input, with_kwargs=True)
        if self.attention_branch:
            spec.submodule(layer, "attention_out").register_forward_hook(self._apply_attention_update)
        if self.parallel or self.applies_update:
            spec.submodule(layer, "ffn_norm").register_forward_pre_hook(self._record_x, with_kwargs=True)
        if self.applies_update:
            spec.submodule(layer, "ffn_out").register_forward_hook(self._apply_update)

    def uninstall(self, layer: nn.Module) -> None:
        if self.fused_execution is not None:
            self.fused_execution.uninstall()
            self.fused_execution = None
        for module in layer.modules():
            _remove_hooks_of(module, self)


def _remove_hooks_of(module: nn.Module, owner: nn.Module) -> None:
    for hooks, with_kwargs in (
        (module._forward_pre_hooks, module._forward_pre_hooks_with_kwargs),
        (module._forward_hooks, module._forward_hooks_with_kwargs),
    ):
        for key in [k for k, fn in hooks.items() if getattr(fn, "__self__", None) is owner]:
            del hooks[key]
            with_kwargs.pop(key, None)


# ----------------------------------------------------------------------------- checks
def _check_model(model) -> tuple[ArchitectureSpec, nn.ModuleList]:
    """Everything that can be wrong with the model, checked before anything is changed."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"hf_tangent.patch expects a transformers model (nn.Module), got {type(model).__name__}.")
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise ValueError("hf_tangent: this model is already torch.compile'd; patch first, then compile.")
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        raise ValueError("hf_tangent: patch the model before wrapping it in DataParallel/DDP (pass model.module).")
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        raise ValueError(
            "hf_tangent: this model is already wrapped by PEFT; apply hf_tangent.patch first and "
            "get_peft_model after: get_peft_model(hf_tangent.patch(model, cfg), lora_config)."
        )
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise ValueError(f"hf_tangent: {type(model).__name__} has no config.model_type; pass a transformers model.")
    spec = get_spec(model_type)
    layers = spec.decoder_layers(model)
    for i, layer in enumerate(layers):
        if _has_foreign_forward(layer):
            raise ValueError(
                f"hf_tangent: layer {i} ({type(layer).__name__}) has its forward replaced on the instance, "
                "by another patching tool; hf_tangent only patches unmodified layers."
            )
        for role in ("input_norm", "attention", "attention_out", "ffn_norm", "ffn_out"):
            spec.submodule(layer, role)
    return spec, layers


def _has_foreign_forward(layer: nn.Module) -> bool:
    """True when an instance-level `forward` is not the layer class's own forward (or a wrapper of
    it, as transformers' output recording installs): another tool replaced the computation."""
    fn = vars(layer).get("forward")
    own = type(layer).forward
    while fn is not None:
        fn = getattr(fn, "__func__", fn)
        if fn is own:
            return False
        fn = getattr(fn, "__wrapped__", None)
    return "forward" in vars(layer)


def _patched_layers(model) -> list[tuple[nn.Module, TangentLayer]]:
    spec = get_spec(model.config.model_type)
    return [(layer, layer.get_submodule(CHILD_NAME)) for layer in spec.decoder_layers(model) if CHILD_NAME in layer._modules]


# ----------------------------------------------------------------------------- public API
def patch(model, config: TangentConfig):
    """Patch `model` in place with `config` and return it; patching again replaces the patch."""
    if not isinstance(config, TangentConfig):
        raise TypeError(f"hf_tangent.patch expects a TangentConfig, got {type(config).__name__}.")
    spec, layers = _check_model(model)
    num_layers = len(layers)
    updated = set(config.resolve_layers(num_layers))
    parallel = set(config.resolve_parallel_layers(num_layers))
    already = sorted(i for i in parallel if spec.is_parallel(layers[i]))
    if already:
        warnings.warn(
            f"hf_tangent: layers {already} are already parallel-residual blocks; parallel_layers leaves them as they are.",
            stacklevel=2,
        )
        parallel -= set(already)

    unpatch(model)
    try:
        for i in sorted(updated | parallel):
            child = TangentLayer(config, i, update=i in updated, parallel=i in parallel)
            first_param = next(layers[i].parameters(), None)
            if first_param is not None and child.gate is not None:
                child.to(device=first_param.device)
            layers[i].add_module(CHILD_NAME, child)
            child.install(spec, layers[i])
        setattr(model, _MODEL_ATTR, config)
        setattr(model.config, CONFIG_KEY, {
            "config": config.to_dict(),
            "model_type": model.config.model_type,
            "num_layers": num_layers,
            "patched_layers": sorted(updated),
            "parallel_layers": sorted(parallel),
        })
    except BaseException:
        unpatch(model)
        raise
    return model


def unpatch(model):
    """Remove the patch: the model is exactly as before `patch` (bit-identical outputs)."""
    for layer, child in _patched_layers(model):
        child.uninstall(layer)
        del layer._modules[CHILD_NAME]
    vars(model).pop(_MODEL_ATTR, None)
    if hasattr(model.config, CONFIG_KEY):
        delattr(model.config, CONFIG_KEY)
    return model


def _base(model):
    return model.get_base_model() if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else model


def get_config(model) -> TangentConfig | None:
    """The active TangentConfig of a patched model (also through a PEFT wrapper), or None."""
    return vars(_base(model)).get(_MODEL_ATTR)


def tangent_layers(model) -> list[TangentLayer]:
    """The per-layer patch modules, in layer order."""
    return [child for _, child in _patched_layers(_base(model))] if get_config(model) else []
