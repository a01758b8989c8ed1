"""The public operations on a patched model: `patch` (atomic), `unpatch`, `update_config`, `disabled`,
`set_homotopy`, `get_config`, `tangent_layers`. How a patch is installed and taken off is install.py's, the
part a saved folder ships as remote code; these operations run in the installed package only.

A saved folder's remote code hands its patch to an installed hf_tangent of the folder's release or a newer
one (remote.py), so such a model is this package's own. A folder loaded without one (or with an older one)
is patched by the folder's copy of the core: `get_config` reads that patch, and every other operation hands
the model to that copy (`_delegate`), which refuses what it does not ship (folders saved before this split
ship the whole of these operations).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import sys
from typing import Literal

import torch
from torch import nn

from . import _version, install
from .config import TangentConfig
from .gather import sharding_engine
from .install import (
    _MODEL_ATTR,
    CHILD_NAME,
    CONFIG_KEY,
    _apply,
    _patched_layers,
    _refuse_fused_blend,
    _remove,
    _snapshot,
)
from .layer import TangentLayer
from .wrappers import unwrap

_DISABLED_ATTR = "_hf_tangent_disabled"  # True inside `with disabled(model)`: patch / unpatch refuse there
HomotopySchedule = Literal[install.HOMOTOPY_SCHEDULES]


def _refuse_inside_disabled(base, function: str) -> None:
    if vars(base).get(_DISABLED_ATTR):
        raise ValueError(f"hf_tangent.{function}: the model is inside `with hf_tangent.disabled(model):`, which puts its "
                         f"patch back when the block ends, so this change would be undone silently; call "
                         f"hf_tangent.{function} after the block.")


def _refuse_layers_of_another(base, function: str) -> None:
    """A module that holds patched layers without their patch (`model.model` of a patched model, the model around a
    patched `model.model`, a wrapper that unwrap does not know): the patch is the patched module's. Any copy's
    patched layers count (a folder's remote code may have patched the model: its TangentLayer is another class)."""
    if _MODEL_ATTR not in vars(base) and any(CHILD_NAME in module._modules for module in base.modules()):
        raise ValueError(f"hf_tangent.{function}: this {type(base).__name__} holds patched layers, but the patch belongs "
                         "to the module that was patched (the one passed to hf_tangent.patch, which holds this one or "
                         f"is inside it: through torch.compile its `_orig_mod`, through PEFT `get_base_model()`); pass "
                         "that module.")


def _refuse_compiled_or_wrapped(model) -> None:
    """A model compiled or wrapped already: the patch's hooks would never run, or its gates be missed."""
    if not isinstance(model, nn.Module):
        return  # refused by install._check_model with what is accepted
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise ValueError("hf_tangent: this model is already torch.compile'd; patch first, then compile.")
    compiled = [name or "the model" for name, m in model.named_modules() if getattr(m, "_compiled_call_impl", None)]
    if compiled:
        raise ValueError(f"hf_tangent: {compiled[0]} was compiled in place (module.compile()), so hooks added now "
                         "would never run; patch an uncompiled model, then compile.")
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        raise ValueError("hf_tangent: patch before wrapping: this model is already wrapped in DataParallel/DDP, "
                         "whose gradient synchronisation would miss the patch's gates.")
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        raise ValueError(
            "hf_tangent: this model is already wrapped by PEFT; apply hf_tangent.patch first and "
            "get_peft_model after: get_peft_model(hf_tangent.patch(model, cfg), lora_config)."
        )
    engine = sharding_engine(model)
    if engine is not None or type(model).__name__ == "DeepSpeedEngine":
        raise ValueError(f"hf_tangent: patch before wrapping: this model is already sharded by {engine or 'DeepSpeed'}, "
                         "which would neither shard nor synchronise the patch's gates. Patch the plain model, "
                         "then hand it to FSDP / DeepSpeed / the Trainer.")
    if _ddp_wrapper_of(model) is not None:
        raise ValueError("hf_tangent: patch before wrapping: this model is the .module of a DistributedDataParallel "
                         "wrapper, which would not synchronise the patch's gates. Patch the plain model, then wrap it.")


def _ddp_wrapper_of(model: nn.Module):
    """The DistributedDataParallel that wraps `model`, found from the model's side (a user who
    passes `ddp.module` after wrapping), or None. Only looked for in an initialised process group."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    ddp = nn.parallel.DistributedDataParallel
    frontier = [model]
    for _ in range(3):  # model <- DDP._modules <- (DDP.__dict__ <-) DDP
        referrers = [r for obj in frontier for r in gc.get_referrers(obj)]
        for ref in referrers:
            if isinstance(ref, ddp) and ref.module is model:
                return ref
        frontier = [r for r in referrers if isinstance(r, dict)]
    return None


def require_model(model, function: str):
    """The transformers model inside any wrapper, or a TypeError that names what was passed."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"hf_tangent.{function} expects a transformers model (nn.Module), got {type(model).__name__}.")
    base = unwrap(model)
    if getattr(getattr(base, "config", None), "model_type", None) is None:
        raise TypeError(f"hf_tangent.{function} expects a transformers model (a module with config.model_type), got "
                        f"{type(base).__name__}.")
    return base


def _owner(model):
    """The patching module of another copy of this core whose patch `model` carries, or None (unpatched, or
    patched by this copy). A model loaded through a saved folder's remote code is patched by the folder's copy
    of these modules: its layers and config are that copy's classes, so the public functions below hand such a
    model to that copy, which works on its own patch exactly as this one works on its own."""
    config = vars(unwrap(model)).get(_MODEL_ATTR) if isinstance(model, nn.Module) else None
    if config is None or type(config) is TangentConfig:
        return None
    owner = getattr(type(config), "_patching", None)  # set below by each copy on its own class
    if owner is None:  # a copy older than that attribute
        owner = sys.modules.get(type(config).__module__.rpartition(".")[0] + ".patching")
    if owner is None or owner is install:
        raise ValueError(f"hf_tangent: the model's patch was made by {type(config).__module__}, whose patching module "
                         "is not loaded; load the model with hf_tangent.from_pretrained instead.")
    return owner



def _delegate(model, function: str, *args, **kwargs):
    """`function` of the copy that owns the model's patch (see _owner)."""
    owner = _owner(model)
    target = getattr(owner, function, None)
    if target is None:
        version = getattr(sys.modules.get(owner.__name__.rpartition(".")[0] + "._version"), "__version__", "?")
        raise ValueError(f"hf_tangent.{function}: the model's patch was made by the remote code of a folder saved with "
                         f"hf_tangent {version} ({owner.__name__}), which has no {function} (it hands its patch to an "
                         f"installed hf_tangent of its release or newer; this one is {_version.__version__}); load the folder "
                         "with hf_tangent.from_pretrained, or upgrade hf_tangent and load it again.")
    try:
        return target(model, *args, **kwargs)
    except Exception as err:
        own = _as_own_error(err, owner)
        if own is err:
            raise
        raise own from err


def _as_own_error(err: Exception, owner) -> Exception:
    """An error of the owning copy's own classes (options.RangeError ...) as this copy's class of that name,
    same message, so that `except hf_tangent...RangeError` catches it; any other error as it is."""
    package, module = owner.__name__.rpartition(".")[0], type(err).__module__
    if not module.startswith(package + "."):
        return err
    ours = getattr(sys.modules.get(f"{__package__}.{module[len(package) + 1:]}"), type(err).__name__, None)
    if not (isinstance(ours, type) and issubclass(ours, Exception)):
        return err
    own = ours.__new__(ours)
    own.args = err.args
    vars(own).update(vars(err))
    return own


def _as_owner_config(owner, config):
    """`config` as a TangentConfig of the owning copy (its own class: the copies do not share classes)."""
    if not hasattr(config, "to_dict"):
        raise TypeError(f"hf_tangent.patch expects a TangentConfig, got {type(config).__name__}.")
    return owner.TangentConfig.from_dict(config.to_dict(), strict=True)


# ----------------------------------------------------------------------------- public API
def patch(model, config: TangentConfig):
    """Patch `model` in place with a frozen copy of `config` and return it.

    Patching again replaces the patch. The call is atomic: if anything is wrong (the model, the
    config, a layer), it raises and the model keeps its previous patch, gate values included.
    """
    if _owner(model) is not None:
        return _delegate(model, "patch", _as_owner_config(_owner(model), config))
    _refuse_compiled_or_wrapped(model)
    if isinstance(model, nn.Module):
        _refuse_layers_of_another(model, "patch")
    return install._patch(model, config, verify=True)


def unpatch(model):
    """Remove the patch (also through PEFT/DDP wrappers): outputs are bit-identical to the model
    before `patch`. A model without a patch of its own whose config holds another model's record (built from a
    patched model's config) gets a config of its own without it, so that it saves as what it is. Returns the
    model as passed."""
    base = require_model(model, "unpatch")
    if _owner(base) is not None:
        return _delegate(model, "unpatch")
    _refuse_inside_disabled(base, "unpatch")
    _refuse_layers_of_another(base, "unpatch")
    state = _snapshot(base)
    if state.config is None and getattr(base.config, CONFIG_KEY, None) is not None:
        # no patch of its own, on the config of a patched model (built from it: transformers shares the object), so
        # it would save that model's patch: a config of its own, whose record _remove takes off (the other model's
        # stays as it is)
        install._own_config(base)
        state.record = getattr(base.config, CONFIG_KEY)
    _remove(base, state)
    return model


def update_config(model, **changes):
    """Change fields of the active patch, validated: the patch and its saved record follow; gate
    values of layers that stay gated and the homotopy lambda (set_homotopy) are kept.
    `update_config(model, beta=0.5)`."""
    base = require_model(model, "update_config")
    if _owner(base) is not None:
        return _delegate(model, "update_config", **changes)
    _refuse_inside_disabled(base, "update_config")
    current = get_config(base)
    if current is None:
        raise ValueError("hf_tangent.update_config: the model is not patched; use hf_tangent.patch(model, config).")
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(TangentConfig)})
    if unknown:
        raise ValueError(f"hf_tangent.update_config: unknown TangentConfig fields {unknown}.")
    new = dataclasses.replace(current, **changes)
    record = getattr(base.config, CONFIG_KEY, {})
    homotopy, layers = record.get("homotopy"), record.get("num_layers")
    if homotopy is not None and isinstance(get_homotopy(base), dict):  # per layer: the layers must stay the same
        before = sorted(set(current.resolve_layers(layers)) | set(current.resolve_parallel_layers(layers)))
        after = sorted(set(new.resolve_layers(layers)) | set(new.resolve_parallel_layers(layers)))
        if before != after:
            raise ValueError(f"hf_tangent.update_config: the patch has a per-layer homotopy lambda on layers {before}; "
                             f"the change patches layers {after}, which would leave layers without their lambda. "
                             "Set one lambda with hf_tangent.set_homotopy(model, value) first, or keep the layers.")
    lambdas = get_homotopy(base)
    if homotopy is not None:  # refused here, before the model changes
        parallel = new.resolve_parallel_layers(layers)
        _refuse_fused_blend(new, parallel, lambdas if isinstance(lambdas, dict) else dict.fromkeys(parallel, lambdas),
                            "update_config")
    gates = {c.index: c.gate.detach().clone() for c in tangent_layers(base) if c.gate is not None}
    patch(base, new)
    with torch.no_grad():
        for child in tangent_layers(base):
            if child.gate is not None and child.index in gates:
                child.gate.copy_(gates[child.index].reshape(child.gate.shape))
    if homotopy is not None:
        set_homotopy(base, lambdas, schedule=homotopy.get("schedule"), steps=homotopy.get("steps"))
    return model


@contextlib.contextmanager
def preserved(model):
    """Whatever is patched, converted or unpatched inside the block is undone on exit (also after
    an exception): the model's patch is the very same one as before, gate values and lambda included.
    The shared context of the analyses (they patch the model they are given, to compare rules)."""
    base = unwrap(model)
    if _owner(base) is not None:
        with _delegate(model, "preserved"):
            yield model
        return
    state, marker = _snapshot(base), vars(base).pop(_DISABLED_ATTR, None)
    state.record = copy.deepcopy(state.record)  # set_homotopy writes into the record and the layers
    blends = [(child, child.blend) for _, child in state.children]
    try:
        yield model
    finally:
        try:
            _remove(base, _snapshot(base))
            for child, blend in blends:
                child.blend = blend
            try:
                _apply(base, state)
            except BaseException as err:  # never half-patched: what was put back comes off again
                _remove(base, _snapshot(base))
                if not isinstance(err, Exception):  # KeyboardInterrupt, SystemExit: as they are
                    raise
                raise RuntimeError(f"hf_tangent: the model's patch could not be put back after the block ({err!r}); "
                                   "the model is left unpatched: patch it again.") from err
        finally:
            if marker is not None:
                vars(base)[_DISABLED_ATTR] = marker


@contextlib.contextmanager
def without_patch(model):
    """The model unpatched inside the block, free to be patched and unpatched by an analysis that
    compares rules on it; the very same patch back on exit (preserved). `disabled` is the public
    form, which refuses patching inside."""
    if _owner(model) is not None:
        with _delegate(model, "without_patch"):
            yield model
        return
    with preserved(model):
        _remove(unwrap(model), _snapshot(unwrap(model)))
        yield model


@contextlib.contextmanager
def disabled(model):
    """Within the block the model is unpatched (bit-identical to the model before `patch`); on exit,
    also after an exception, the very same patch is back, gate values included. `patch`, `unpatch`,
    `update_config` and `set_homotopy` refuse inside the block (their change would be undone)."""
    base = require_model(model, "disabled")
    if _owner(base) is not None:
        with _delegate(model, "disabled"):
            yield model
        return
    _refuse_layers_of_another(base, "disabled")
    with preserved(base):
        _remove(base, _snapshot(base))
        vars(base)[_DISABLED_ATTR] = True
        try:
            yield model
        finally:
            vars(base).pop(_DISABLED_ATTR, None)


def set_homotopy(model, value, *, schedule: str | None = None, steps: int | None = None):
    """Blend the patch with the unpatched model: lambda = `value` in [0, 1], for every patched layer,
    or a mapping {layer index: lambda} that gives every patched layer its own (progressive healing;
    keys may be digit strings, as in the saved JSON). Each patched layer's update becomes
    (1 - lambda) y + lambda (x_next - x), and a parallel-converted layer's FFN reads
    (1 - lambda) r + lambda h (r: the residual after attention, h: the block input). lambda = 0 is
    bit-identical to the unpatched model, 1 to the patch. Recorded in the saved patch, with the
    schedule (`schedule`, `steps`) that set it, if any."""
    base = require_model(model, "set_homotopy")
    if _owner(base) is not None:
        return _delegate(model, "set_homotopy", value, schedule=schedule, steps=steps)
    _refuse_inside_disabled(base, "set_homotopy")
    install.set_homotopy(base, value, schedule=schedule, steps=steps)
    return model


def get_homotopy(model) -> float | dict[int, float] | None:
    """The patch's homotopy lambda (1.0 unless set_homotopy changed it); {layer: lambda} when the
    layers differ; None when the model is not patched (as get_config)."""
    if _owner(model) is not None:
        return _delegate(model, "get_homotopy")
    if get_config(model) is None:
        return None
    values = {child.index: child.blend for child in tangent_layers(model)}
    if len(set(values.values())) <= 1:
        return next(iter(values.values()), 1.0)
    return values


def get_config(model) -> TangentConfig | None:
    """The active (read-only) TangentConfig of a patched model, through any wrapper, or None. (For a model
    patched by a folder's remote code: a read-only copy in this copy's class.)"""
    config = vars(require_model(model, "get_config")).get(_MODEL_ATTR)
    if _owner(model) is not None:
        config = TangentConfig.from_dict(config.to_dict(), strict=True).frozen_copy()
    return config


def tangent_layers(model) -> list[TangentLayer]:
    """The per-layer patch modules, in layer order (through PEFT, DDP, FSDP and DeepSpeed wrappers)."""
    if _owner(model) is not None:
        return _delegate(model, "tangent_layers")
    return [child for _, child in _patched_layers(model)] if get_config(model) else []
