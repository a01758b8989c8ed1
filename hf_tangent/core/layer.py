"""`TangentLayer`: the patch of one decoder layer, its update rule, gate and hook callbacks.

A layer's forward is never replaced: the hooks sit on the layer's own submodules (see install.py
for the list). What a pre-hook hands the hook after it is stored under the calling thread's key and
popped by that hook, so it never outlives the layer call. Everything else (the rule and its
arguments, the architecture, which hooks exist) is decided at patch time: the steady-state cost per
layer call is two hooks and the rule.
"""

from __future__ import annotations

import functools
import sys
import threading

import torch
from torch import nn

from .config import NOISE_UPDATES, TangentConfig
from .fused import fused_residual_delta
from .noise import noise_delta
from .registry import ArchitectureSpec

_ident = threading.get_ident


@torch.compiler.assume_constant_result  # a compiled graph traces the hand-over away: one constant key serves it
def call_key() -> int:
    """The calling thread's key: two threads running one model never see each other's tensors."""
    return _ident()


_KERNELS: dict = {}  # name -> the rule or class the package adds: "reference", "triton" (delta functions), "fused_parallel"
_KERNEL_LOADERS: dict = {}  # name -> loader (hf_tangent/core/__init__.py; remote code ships none)


def register_kernel(name: str, loader) -> None:
    _KERNEL_LOADERS[name] = loader


def _load(name: str):
    if name not in _KERNELS:
        if name not in _KERNEL_LOADERS:
            raise ValueError(f"hf_tangent: implementation={name!r} needs the installed hf_tangent; a saved folder's "
                             "remote code runs the same rule as implementation='fused'.")
        _KERNELS[name] = _KERNEL_LOADERS[name]()
    return _KERNELS[name]


class TangentLayer(nn.Module):
    """The patch of one decoder layer: its update rule, optional FFN gate, and hook callbacks."""

    _NO_SITE = (nn.Module(), "", None)  # a layer without an ffn_out hook (a parallel conversion alone)

    def __init__(self, config: TangentConfig, index: int, *, update: bool, parallel: bool):
        if not isinstance(config, TangentConfig):
            raise TypeError(f"TangentLayer: config={config!r} has the wrong type ({type(config).__name__}); accepted: a "
                            "TangentConfig.")
        if not isinstance(index, int) or isinstance(index, bool):
            raise TypeError(f"TangentLayer: index={index!r} has the wrong type ({type(index).__name__}); accepted: an "
                            "integer >= 0.")
        if index < 0:
            raise ValueError(f"TangentLayer: index={index!r} is out of range; accepted: an integer >= 0.")
        for name, flag in (("update", update), ("parallel", parallel)):
            if not isinstance(flag, bool):
                raise TypeError(f"TangentLayer: {name}={flag!r} has the wrong type ({type(flag).__name__}); accepted: "
                                "true or false.")
        super().__init__()
        self.config = config
        self.index = index
        self.parallel = parallel
        gated = update and config.gates
        self.gate = nn.Parameter(torch.ones(1, dtype=torch.float32)) if gated else None
        # An 'add' update without alpha or gate is the model's own add: no hook needed.
        self.applies_update = update and (config.update != "add" or config.alpha != 1.0 or gated)
        self.attention_branch = update and "attention" in config.branches and config.update != "add"
        self.fused_execution = None  # fused_parallel.FusedParallelExecution when parallel_execution="fused"
        self.spec: ArchitectureSpec | None = None  # set by prepare
        self.scale = 1.0  # s in out = r + s * ffn_out(...) (residual multipliers)
        self.exact_in_training = True  # False: dropout acts after ffn_out, so only eval mode is exact
        self._blend = 1.0  # homotopy lambda (patching.set_homotopy): 0 = the unpatched layer, 1 = the patch
        # What a pre-hook hands the hook after it, per thread (call_key), popped by the consumer: nothing
        # outlives a layer call. "x": the FFN's residual input; "h": the block input (parallel conversion);
        # "attention_x": the attention branch's residual input.
        self._pending: dict[str, dict[int, torch.Tensor]] = {"x": {}, "h": {}, "attention_x": {}}
        self._sites: dict[str, tuple] = {}  # role -> (parent, attribute, hooked module)
        self.roles = tuple(role for role, needed in (
            ("input_norm", parallel or self.attention_branch),
            ("attention_out", self.attention_branch),
            ("ffn_norm", parallel or self.applies_update),
            ("ffn_out", self.applies_update),
        ) if needed)
        self._rule = None if config.update in NOISE_UPDATES else functools.partial(
            fused_residual_delta if config.implementation == "fused" else _load(config.implementation),
            update=config.update, alpha=config.alpha, beta=config.beta, p=config.p, eps=config.eps,
            eps_mode=config.eps_mode)
        self._direct = False  # the FFN hook may call the rule itself (_refresh)

    @property
    def blend(self) -> float:
        return self._blend

    @blend.setter
    def blend(self, value: float) -> None:
        self._blend = value
        self._refresh()

    def _refresh(self) -> None:
        """Decided once per change, not per call: whether the FFN hook hands the rule the output as it is (no
        noise, homotopy or residual scale in between)."""
        self._direct = self._rule is not None and self.scale == 1.0 and self._blend == 1.0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x_next - x in y's dtype (float32 arithmetic inside)."""
        if self._rule is None:
            c = self.config
            delta = noise_delta(x, y, c.update, alpha=c.alpha, gamma=c.gamma, h=c.noise_h, rank=c.noise_rank,
                                training=self.training, gate=self.gate)
        else:
            delta = self._rule(x, y, gate=self.gate)
        if self._blend != 1.0:  # the homotopy (1 - lambda) y + lambda (x_next - x), in float32; lambda = 0 gives y exactly
            delta = torch.lerp(y.float(), delta.float(), self._blend).to(y.dtype)
        return delta

    def extra_repr(self) -> str:
        c = self.config
        rule = c.update if self.applies_update else "add"
        extra = {"soft": f", beta={c.beta}", "retract": f", p={c.p}"}.get(rule, "")
        return f"layer={self.index}, update={rule}{extra}, alpha={c.alpha}, gate={self.gate is not None}, parallel={self.parallel}"

    # --- hook callbacks (bound methods, so unpatch can find them and deepcopy rebinds them). The hot path:
    # a pre-hook stores a tensor under the thread's key, the hook after it pops it; no per-call checks but
    # one identity test of the module the pre-hook's consumer sits on (a wrapper put there since the patch).
    def _record_block_input(self, module, args, kwargs):
        h = args[0] if args else next(iter(kwargs.values()))
        key = call_key()
        if self.parallel:
            self._pending["h"][key] = h
        if self.attention_branch:
            self._follow("attention_out")
            self._pending["attention_x"][key] = h

    def _apply_attention_update(self, module, args, output):
        """The rule on the attention branch (branches includes 'attention'): x = the block input."""
        x = self._pending["attention_x"].pop(call_key(), None)
        if x is None:
            self._check_called_alone("input_norm")
            return None
        return self._scaled(x, output)

    def _record_x(self, module, args, kwargs):
        if self.training and not self.exact_in_training and self.applies_update:
            raise RuntimeError(
                f"hf_tangent: layer {self.index} applies dropout after the module whose output it adds "
                f"({self.spec.ffn_out_path}), so the patch is exact in eval mode only; set the model's dropout "
                "probabilities to 0 (e.g. config.dropout=0.0 when building it) to train it patched."
            )
        key = call_key()
        x = args[0] if args else next(iter(kwargs.values()))
        if self.parallel:
            h = self._pending["h"].pop(key, None)
            if h is None:  # the norm called on its own, outside the layer's forward: leave it alone
                return None
            if self._blend != 1.0:  # homotopy: the FFN input moves from the residual after attention to the block input
                h = torch.lerp(x.float(), h.float(), self._blend).to(x.dtype)
            if self.applies_update:
                self._pending["x"][key] = h
            args = ((h,) + tuple(args[1:]), kwargs) if args else ((h,), {})
        else:
            self._pending["x"][key] = x
        parent, name, hooked = self._sites.get("ffn_out", self._NO_SITE)
        if parent._modules.get(name) is not hooked:
            self._follow("ffn_out")
        return args if self.parallel else None

    def _apply_update(self, module, args, output):
        x = self._pending["x"].pop(call_key(), None)
        if x is None:
            self._check_called_alone("input_norm" if self.parallel else "ffn_norm")
            return None
        if (self._direct and not isinstance(output, tuple) and not self._forward_pre_hooks and not self._forward_hooks
                and "forward" not in self.__dict__):  # the rule on the output as it is (see _wrapped)
            return self._rule(x, output, gate=self.gate)
        return self._scaled(x, output)

    def _scaled(self, x, output):
        """The layer adds s * output: the rule sees y = s * output and returns (x_next - x) / s."""
        y = output[0] if isinstance(output, tuple) else output
        if self.scale != 1.0:
            y = y * self.scale
        delta = self(x, y) if self._wrapped() else self.forward(x, y)
        if self.scale != 1.0:
            delta = delta / self.scale
        return (delta,) + tuple(output[1:]) if isinstance(output, tuple) else delta

    def _wrapped(self) -> bool:
        """True when something hooks this child or replaced its forward: DeepSpeed ZeRO-3 gathers the gate in a
        pre-forward hook, accelerate's offload moves it to the device in a replaced forward. Then the child is
        called as a module, else its rule directly (the same arithmetic, without the module call's dispatch)."""
        return bool(self._forward_pre_hooks or self._forward_hooks or "forward" in self.__dict__)

    def _follow(self, role: str) -> None:
        """`role`'s module replaced in its parent since the patch (PEFT wraps a Linear in a LoRA layer that calls
        it as `base_layer`): hook the module that now sits there, before it runs, so the rule sees the output the
        layer adds, adapter included (the hook left on the inner module would see the output without it)."""
        parent, name, module = self._sites[role]
        current = parent._modules.get(name)
        if current is not module:
            _remove_hooks_of(module, self)
            self._hook_module(current, role)
            self._sites[role] = (parent, name, current)

    def _check_called_alone(self, role: str) -> None:
        """A hooked module ran without the pre-hook before it. Called on its own (outside the layer's forward) it
        is left alone; inside the layer's forward, the layer bypassed `role`'s module (its forward was replaced
        since the patch, e.g. a norm applied functionally), so the patch cannot apply: raise. The rare path only:
        it reads the Python stack, which the layer call does not pay for."""
        parent, name, module = self._sites[role]
        replaced = parent._modules.get(name) is not module
        frame, layer = sys._getframe(2), vars(self).get("_layer")
        while frame is not None and not replaced:  # the layer's forward (not a hook of the layer's) is running
            replaced = frame.f_code.co_name == "forward" and frame.f_locals.get("self") is layer
            frame = frame.f_back
        if replaced:
            raise RuntimeError(
                f"hf_tangent: layer {self.index} ({type(layer).__name__}) ran without calling its {role} submodule "
                f"({parent._modules.get(name).__class__.__name__} at '{name}'), so its patch did not apply: the "
                "layer's forward or that module was replaced since the patch by code that hf_tangent's hooks cannot "
                "see (e.g. a norm applied functionally). Patch an unmodified model, or remove the patch with "
                "hf_tangent.unpatch(model)."
            )

    def prepare(self, spec: ArchitectureSpec, layer: nn.Module, *, exact_in_training: bool = True) -> None:
        """Everything that can fail, before the model is touched."""
        self.spec, self.scale, self.exact_in_training = spec, spec.scale(layer), exact_in_training
        self._refresh()
        # a folder's copy of the core has no fused_parallel.py: there the same layers run with the hooks (its
        # record, and what it refuses, stay those of parallel_execution="fused")
        if self.parallel and self.config.parallel_execution == "fused" and "fused_parallel" in _KERNEL_LOADERS:
            self.fused_execution = _load("fused_parallel")(spec, layer)
        for role in self.roles:
            spec.submodule(layer, role)
        param = next(layer.parameters(), None)
        if param is not None and self.gate is not None and not self.gate.is_meta:  # meta: from_pretrained fills it
            self.to(device=param.device)

    def _hook(self, layer: nn.Module, role: str) -> None:
        """Hook `role`'s submodule and remember where it sits (its parent and attribute name)."""
        module = self.spec.submodule(layer, role)
        self._hook_module(module, role)
        self._sites[role] = _site(layer, module)

    def _hook_module(self, module: nn.Module, role: str) -> None:
        if role in ("input_norm", "ffn_norm"):
            callback = self._record_block_input if role == "input_norm" else self._record_x
            module.register_forward_pre_hook(callback, with_kwargs=True)
        else:
            module.register_forward_hook(self._apply_attention_update if role == "attention_out" else self._apply_update)

    def install(self, layer: nn.Module) -> None:
        vars(self)["_layer"] = layer  # not a submodule: the layer holds this child
        self._sites = {}  # role -> (parent, attribute name, the hooked module)
        if self.fused_execution is not None:
            self.fused_execution.install()
        for role in ("input_norm", "attention_out", "ffn_norm", "ffn_out"):
            if role in self.roles:
                self._hook(layer, role)

    def clear_around(self, runner: nn.Module, children) -> None:
        """Hand-overs never outlive a model call: what an aborted call (an exception between a pre-hook and its
        consumer) or a norm called on its own left is dropped when the module that runs the decoder layers starts
        and ends a call (also on an exception: always_call). One pair of hooks for the model, not per layer."""
        vars(self)["_runner"], vars(self)["_siblings"] = runner, tuple(children)  # not submodules
        runner.register_forward_pre_hook(self._begin_model_call)
        runner.register_forward_hook(self._end_model_call, always_call=True)

    def _begin_model_call(self, module, args):
        self._clear()

    def _end_model_call(self, module, args, output):
        self._clear()

    def _clear(self) -> None:
        key = call_key()
        for child in self._siblings:
            for pending in child._pending.values():
                pending.pop(key, None)
            if child.fused_execution is not None:
                child.fused_execution.pending = None

    def uninstall(self, layer: nn.Module) -> None:
        if self.fused_execution is not None:
            self.fused_execution.uninstall()
        for module in layer.modules():
            _remove_hooks_of(module, self)
        for _, _, module in self._sites.values():  # a module hooked before a wrapper replaced it (see _follow)
            _remove_hooks_of(module, self)
        runner = vars(self).pop("_runner", None)
        if runner is not None:
            _remove_hooks_of(runner, self)
            vars(self).pop("_siblings", None)
        self._sites = {}
        for pending in self._pending.values():
            pending.clear()


def _site(layer: nn.Module, module: nn.Module) -> tuple[nn.Module, str, nn.Module]:
    """(parent, attribute name, module) of a submodule of `layer`."""
    name = next(n for n, m in layer.named_modules() if m is module)
    parent, _, attribute = name.rpartition(".")
    return layer.get_submodule(parent), attribute, module


def _remove_hooks_of(module: nn.Module, owner: nn.Module) -> None:
    for hooks, extras in (
        (module._forward_pre_hooks, (module._forward_pre_hooks_with_kwargs,)),
        (module._forward_hooks, (module._forward_hooks_with_kwargs, module._forward_hooks_always_called)),
    ):
        for key in [k for k, fn in hooks.items() if getattr(fn, "__self__", None) is owner]:
            del hooks[key]
            for extra in extras:
                extra.pop(key, None)
