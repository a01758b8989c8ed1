"""`TangentLayer`: the patch of one decoder layer, its update rule, gate and hook callbacks.

A layer's forward is never replaced: the hooks sit on the layer and its own submodules (see
patching.py for the list). What one hook hands the next lives in that call's state, keyed by
thread, and never outlives the call; on every call the layer checks that each of its hooks fired.
"""

from __future__ import annotations

import torch
from torch import nn

from .calls import call_key
from .config import NOISE_UPDATES, TangentConfig
from .fused import fused_residual_delta
from .fused_parallel import FusedParallelExecution
from .registry import ArchitectureSpec
from .rules import noise_delta, residual_delta

_KERNELS: dict = {}  # implementation -> delta function, for the optional kernels


def _load_triton():
    # triton is an optional extra: its kernels are imported only when implementation="triton" is used
    if "triton" not in _KERNELS:
        from .triton_update import triton_residual_delta

        _KERNELS["triton"] = triton_residual_delta
    return _KERNELS["triton"]


class TangentLayer(nn.Module):
    """The patch of one decoder layer: its update rule, optional FFN gate, and hook callbacks."""

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
        self.fused_execution = None  # FusedParallelExecution when parallel_execution="fused"
        self.spec: ArchitectureSpec | None = None  # set by prepare
        self.scale = 1.0  # s in out = r + s * ffn_out(...) (residual multipliers)
        self.exact_in_training = True  # False: dropout acts after ffn_out, so only eval mode is exact
        self.blend = 1.0  # homotopy lambda (patching.set_homotopy): 0 = the unpatched layer, 1 = the patch
        self._calls: dict[int, dict] = {}  # call_key() -> what this call's hooks hand each other
        self._sites: dict[str, tuple] = {}  # role -> (parent, attribute, hooked module): install
        # the submodule roles whose hooks must fire in every call of the layer
        self.roles = tuple(role for role, needed in (
            ("input_norm", parallel or self.attention_branch),
            ("attention_out", self.attention_branch),
            ("ffn_norm", parallel or self.applies_update),
            ("ffn_out", self.applies_update),
        ) if needed)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x_next - x in y's dtype (float32 arithmetic inside)."""
        c = self.config
        if c.update in NOISE_UPDATES:
            delta = noise_delta(x, y, c.update, alpha=c.alpha, gamma=c.gamma, h=c.noise_h, rank=c.noise_rank,
                                training=self.training, gate=self.gate)
        else:
            if c.implementation == "triton":
                rule = _KERNELS.get("triton") or _load_triton()  # loaded at patch time: a lookup that compiles
            else:
                rule = fused_residual_delta if c.implementation == "fused" else residual_delta
            delta = rule(x, y, c.update, alpha=c.alpha, beta=c.beta, p=c.p, eps=c.eps, eps_mode=c.eps_mode, gate=self.gate)
        if self.blend != 1.0:  # the homotopy (1 - lambda) y + lambda (x_next - x), in float32; lambda = 0 gives y exactly
            delta = torch.lerp(y.float(), delta.float(), self.blend).to(y.dtype)
        return delta

    def extra_repr(self) -> str:
        c = self.config
        rule = c.update if self.applies_update else "add"
        extra = {"soft": f", beta={c.beta}", "retract": f", p={c.p}"}.get(rule, "")
        return f"layer={self.index}, update={rule}{extra}, alpha={c.alpha}, gate={self.gate is not None}, parallel={self.parallel}"

    # --- hook callbacks (bound methods, so unpatch can find them and deepcopy rebinds them)
    def _enter(self, module, args, kwargs):
        if module.training and not self.exact_in_training and self.applies_update:
            raise RuntimeError(
                f"hf_tangent: layer {self.index} ({type(module).__name__}) applies dropout after the module whose "
                f"output it adds ({self.spec.ffn_out_path}), so the patch is exact in eval mode only; set the "
                "model's dropout probabilities to 0 (e.g. config.dropout=0.0 when building it) to train it patched."
            )
        self._follow_wrappers(module)
        self._calls[call_key()] = {"layer": True}

    def _exit(self, module, args, output):
        key = call_key()
        state = self._calls.pop(key, None)
        fused = self.fused_execution.release(key) if self.fused_execution is not None else True
        if output is None or state is None:  # the forward raised (always_call): nothing to check
            return None
        if not fused:
            raise RuntimeError(
                f"hf_tangent: layer {self.index} ({type(module).__name__}) ran with parallel_execution='fused', but not "
                "every input projection took its slice of the fused GEMM (a projection's forward was replaced after "
                "the patch, e.g. by an adapter), so its output mixes fused and unfused projections. Patch again "
                "(hf_tangent.patch) after changing the layer, or use parallel_execution='hooks'."
            )
        missing = [role for role in self.roles if role not in state]
        if missing:
            raise RuntimeError(
                f"hf_tangent: layer {self.index} ({type(module).__name__}) ran without calling its "
                f"{', '.join(missing)} submodule(s), so its patch did not apply: the layer's forward was "
                "replaced by code that hf_tangent's hooks cannot see (e.g. a norm applied functionally). "
                "Patch an unmodified model, or remove the patch with hf_tangent.unpatch(model)."
            )
        return None

    def _state(self, role: str) -> dict | None:
        """This call's state when `role`'s hook fires inside the layer's forward, else None.

        The layer's own hooks open the state. transformers 5 checkpoints the layer's `forward`
        (not `__call__`), so the backward's recomputation runs without them: there the first
        role opens a state of its own and the last one closes it."""
        key = call_key()
        state = self._calls.get(key)
        if role == self.roles[0] and (state is None or not state["layer"]) and torch._C._current_graph_task_id() != -1:
            state = self._calls[key] = {"layer": False}  # recomputation during a backward pass
        if state is None or role in state:  # a submodule called on its own, or a second time
            return None
        state[role] = True
        if role == self.roles[-1] and not state["layer"]:
            del self._calls[key]
        return state

    def _record_block_input(self, module, args, kwargs):
        state = self._state("input_norm")
        if state is not None:
            state["block_input"] = state["attention_x"] = args[0] if args else next(iter(kwargs.values()))

    def _apply_attention_update(self, module, args, output):
        """The rule on the attention branch (branches includes 'attention'): x = the block input."""
        state = self._state("attention_out")
        x = None if state is None else state.pop("attention_x", None)
        if x is None:
            return None
        return self._scaled(x, output)

    def _scaled(self, x, output):
        """The layer adds s * output: the rule sees y = s * output and returns (x_next - x) / s."""
        y = output[0] if isinstance(output, tuple) else output
        delta = self(x, y) if self.scale == 1.0 else self(x, y * self.scale) / self.scale
        return (delta,) + tuple(output[1:]) if isinstance(output, tuple) else delta

    def _record_x(self, module, args, kwargs):
        state = self._state("ffn_norm")
        if state is None:
            return None
        if self.parallel:
            x = state.pop("block_input", None)
            if x is None:
                return None
            if self.blend != 1.0:  # homotopy: the FFN input moves from the residual after attention to the block input
                r = args[0] if args else next(iter(kwargs.values()))
                x = torch.lerp(r.float(), x.float(), self.blend).to(r.dtype)
            if self.applies_update:
                state["x"] = x
            return ((x,) + tuple(args[1:]), kwargs) if args else ((x,), {})
        if self.applies_update:
            state["x"] = args[0] if args else next(iter(kwargs.values()))
        return None

    def _apply_update(self, module, args, output):
        state = self._state("ffn_out")
        x = None if state is None else state.pop("x", None)
        if x is None:  # the FFN called on its own, outside the layer's forward: leave it alone
            return None
        return self._scaled(x, output)

    def prepare(self, spec: ArchitectureSpec, layer: nn.Module, *, exact_in_training: bool = True) -> None:
        """Everything that can fail, before the model is touched."""
        self.spec, self.scale, self.exact_in_training = spec, spec.scale(layer), exact_in_training
        if self.config.implementation == "triton":
            _load_triton()
        if self.parallel and self.config.parallel_execution == "fused":
            self.fused_execution = FusedParallelExecution(spec, layer)
        for role in self.roles:
            spec.submodule(layer, role)
        param = next(layer.parameters(), None)
        if param is not None and self.gate is not None and not self.gate.is_meta:  # meta: from_pretrained fills it
            self.to(device=param.device)

    def _hook(self, layer: nn.Module, role: str) -> None:
        """Hook `role`'s submodule and remember where it sits (its parent and attribute name)."""
        module = self.spec.submodule(layer, role)
        if role in ("input_norm", "ffn_norm"):
            callback = self._record_block_input if role == "input_norm" else self._record_x
            module.register_forward_pre_hook(callback, with_kwargs=True)
        else:
            module.register_forward_hook(self._apply_attention_update if role == "attention_out" else self._apply_update)
        self._sites[role] = _site(layer, module)

    def _follow_wrappers(self, layer: nn.Module) -> None:
        """A role's module replaced in its parent since the patch (PEFT wraps a Linear in a LoRA layer that
        calls it as `base_layer`): hook the module that now sits there, so the rule sees the output the layer
        adds, adapter included (the hook left on the inner module would see the output without it)."""
        for role, (parent, name, module) in list(self._sites.items()):
            if parent._modules.get(name) is not module:
                _remove_hooks_of(module, self)
                self._hook(layer, role)
        if self.fused_execution is not None and not self.fused_execution.in_place():
            raise RuntimeError(
                f"hf_tangent: layer {self.index} ({type(layer).__name__}) runs with parallel_execution='fused', but an "
                "input projection was replaced since the patch (an adapter such as PEFT's LoRA wraps it), which would "
                "run on the un-normed block input; use parallel_execution='hooks' with adapters."
            )

    def install(self, layer: nn.Module) -> None:
        self._sites = {}  # role -> (parent, attribute name, the hooked module)
        if self.fused_execution is not None:
            self.fused_execution.install()
        for role in ("input_norm", "attention_out", "ffn_norm", "ffn_out"):
            if role in self.roles:
                self._hook(layer, role)
        if self.roles:
            layer.register_forward_pre_hook(self._enter, with_kwargs=True)
            layer.register_forward_hook(self._exit, always_call=True)

    def uninstall(self, layer: nn.Module) -> None:
        if self.fused_execution is not None:
            self.fused_execution.uninstall()
        for module in layer.modules():
            _remove_hooks_of(module, self)
        for _, _, module in self._sites.values():  # a module hooked before a wrapper replaced it (see _follow_wrappers)
            _remove_hooks_of(module, self)
        self._sites = {}
        self._calls.clear()


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
