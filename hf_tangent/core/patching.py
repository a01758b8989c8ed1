"""Patching mechanics: `patch`, `unpatch`, `update_config`, `get_config`.

A layer's forward is never replaced. Each selected decoder layer gets a child module
`tangent_patch` (a `TangentLayer`) whose hooks sit on the layer and its own submodules:

    input_norm  pre-hook   remember the block input            (parallel conversion, attention branch)
    ffn_norm    pre-hook   remember x; feed the block input    (parallel conversion only)
    ffn_out     hook       return x_next - x, so the layer's own `residual + out` is x_next

What a pre-hook hands the hook after it is stored under the calling thread's key and popped by that
hook: two threads running one model never see each other's x, and nothing outlives the call. Nothing
else runs per call; the model is checked, and its layers verified numerically, when the patch is made.
The gate (if any) is a 1-element parameter of the child, which is called in forward (DeepSpeed ZeRO-3
gathers it; FSDP and ZeRO-3 refuse 0-dim parameters). `patch` builds and checks the whole new patch before it touches the
model, and puts the previous patch back if anything fails while installing.
The one exception to "hooks only" is the opt-in fused parallel execution (fused_parallel.py).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import sys
import warnings
from typing import Literal

import torch
from torch import nn

from .config import TangentConfig
from .layer import TangentLayer
from .options import Option, Range
from .registry import (
    BASE_TYPE_ATTR,
    CONFIG_KEY,
    PATCHED_CLASS_PREFIX,
    ArchitectureSpec,
    base_model_type,
    get_registered,
)
from .wrappers import ddp_wrapper_of, model_class, require_model, sharding_engine, unwrap

CHILD_NAME = "tangent_patch"
_MODEL_ATTR = "_hf_tangent_config"
_OWN_CONFIG_ATTR = "_hf_tangent_own_config"  # the model's private transformers config
_DISABLED_ATTR = "_hf_tangent_disabled"  # True inside `with disabled(model)`: patch / unpatch refuse there

# What the installed package adds (hf_tangent/core/__init__.py registers it). A saved folder's remote code ships
# neither discovery.py nor destinations.py: it patches from the spec its record saved (verified when it was
# saved), and its model saves the way transformers saves.
_PACKAGE = {"resolve_spec": None, "require_verified": None, "atomic_save": None}


def register_package(*, resolve_spec, require_verified, atomic_save) -> None:
    _PACKAGE.update(resolve_spec=resolve_spec, require_verified=require_verified, atomic_save=atomic_save)


def _resolve_spec(model) -> ArchitectureSpec:
    if _PACKAGE["resolve_spec"] is not None:
        return _PACKAGE["resolve_spec"](model)
    spec = get_registered(model)
    if spec is None:
        raise ValueError(f"hf_tangent: {type(model).__name__} has no registry entry and no saved spec; its architecture "
                         "is discovered by the installed hf_tangent (pip install hf-tangent), not by a folder's remote "
                         "code.")
    return spec


# ----------------------------------------------------------------------------- checks
def _refuse_inside_disabled(base, function: str) -> None:
    if vars(base).get(_DISABLED_ATTR):
        raise ValueError(f"hf_tangent.{function}: the model is inside `with hf_tangent.disabled(model):`, which puts its "
                         f"patch back when the block ends, so this change would be undone silently; call "
                         f"hf_tangent.{function} after the block.")


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
    if owner is None or owner is sys.modules[__name__]:
        raise ValueError(f"hf_tangent: the model's patch was made by {type(config).__module__}, whose patching module "
                         "is not loaded; load the model with hf_tangent.from_pretrained instead.")
    return owner


# Which copy's functions own a config of this class: transformers 4.x may import a folder's remote code again
# (another folder of the same name), and the classes of the first import then belong to no module in sys.modules.
TangentConfig._patching = sys.modules[__name__]


def _delegate(model, function: str, *args, **kwargs):
    """`function` of the copy that owns the model's patch (see _owner)."""
    owner = _owner(model)
    target = getattr(owner, function, None)
    if target is None:
        version = getattr(sys.modules.get(owner.__name__.rpartition(".")[0] + "._version"), "__version__", "?")
        raise ValueError(f"hf_tangent.{function}: the model's patch was made by the remote code of a folder saved with "
                         f"hf_tangent {version} ({owner.__name__}), which has no {function}; load the folder with "
                         "hf_tangent.from_pretrained to use this function on it.")
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


def _check_model(model) -> tuple[ArchitectureSpec, nn.ModuleList]:
    """Everything that can be wrong with the model, checked before anything is changed."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"hf_tangent.patch expects a transformers model (nn.Module), got {type(model).__name__}.")
    _refuse_inside_disabled(model, "patch")
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
    if ddp_wrapper_of(model) is not None:
        raise ValueError("hf_tangent: patch before wrapping: this model is the .module of a DistributedDataParallel "
                         "wrapper, which would not synchronise the patch's gates. Patch the plain model, then wrap it.")
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise ValueError(f"hf_tangent: {type(model).__name__} has no config.model_type; pass a transformers model.")
    spec = _resolve_spec(model)
    layers = spec.decoder_layers(model)
    first = {}
    for i, layer in enumerate(layers):
        if id(layer) in first:
            raise ValueError(f"hf_tangent: layers {first[id(layer)]} and {i} are one module object (shared weights); "
                             "a patch is per layer, so hf_tangent refuses models that reuse a layer.")
        first[id(layer)] = i
        if _has_foreign_forward(layer):
            raise ValueError(
                f"hf_tangent: layer {i} ({type(layer).__name__}) has its forward replaced on the instance, "
                "by another patching tool; hf_tangent only patches unmodified layers."
            )
        for role in ("ffn_norm", "ffn_out"):
            spec.submodule(layer, role)
    return spec, layers


def _verify(model, spec: ArchitectureSpec, layers, config: TangentConfig, updated: set, parallel: set):
    """The numeric check of where the update lands (discovery.py); None on a meta-device model built
    from a saved patch (remote code inside from_pretrained), which was verified when it was saved."""
    if _PACKAGE["require_verified"] is None:  # remote code: the saved spec was verified when it was saved
        return None
    if any(p.is_meta for p in model.parameters()):
        if spec.source == "registry" or getattr(model.config, CONFIG_KEY, None):
            return None
        raise ValueError("hf_tangent: this model's weights are on the meta device, so its architecture cannot be "
                         "discovered and verified; load the weights first.")
    attention = parallel | (updated if "attention" in config.branches and config.update != "add" else set())
    return _PACKAGE["require_verified"](model, spec, layers, needs_attention=sorted(attention))


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
    """(layer, its TangentLayer) in layer order, found through any wrapper (FSDP1 wraps each layer)."""
    found, seen = [], set()
    for module in unwrap(model).modules():
        child = module._modules.get(CHILD_NAME)
        if isinstance(child, TangentLayer) and id(child) not in seen:
            seen.add(id(child))
            found.append((module, child))
    return sorted(found, key=lambda pair: pair[1].index)


# ----------------------------------------------------------------------------- model state
@dataclasses.dataclass
class _PatchState:
    """Everything `patch` changes on a model, so that a failed call can put it back."""

    children: list[tuple[nn.Module, TangentLayer]]
    config: TangentConfig | None
    record: dict | None


def _snapshot(model) -> _PatchState:
    return _PatchState(_patched_layers(model), vars(model).get(_MODEL_ATTR), getattr(model.config, CONFIG_KEY, None))


def _remove(model, state: _PatchState) -> None:
    _unmark(model)
    for layer, child in state.children:
        child.uninstall(layer)
        if layer._modules.get(CHILD_NAME) is child:
            del layer._modules[CHILD_NAME]
    vars(model).pop(_MODEL_ATTR, None)
    if hasattr(model.config, CONFIG_KEY):
        delattr(model.config, CONFIG_KEY)
    if getattr(type(model.config), _SAVES_PATCHED, False):
        model.config.__class__ = type(model.config).__mro__[1]
    if _PACKAGE["atomic_save"] is not None and isinstance(vars(model).get("save_pretrained"), _PACKAGE["atomic_save"]):
        del vars(model)["save_pretrained"]


def _apply(model, state: _PatchState) -> None:
    for layer, child in state.children:
        child.train(layer.training)  # a new module starts in training mode; the noise rules act only there
        layer.add_module(CHILD_NAME, child)
        child.install(layer)
    if state.children:  # the module that runs the decoder layers drops what an aborted call handed on
        layers = state.children[0][1].spec.decoder_layers(model)
        runner = next(m for m in model.modules() if any(c is layers for c in m._modules.values()))
        state.children[0][1].clear_around(runner, [child for _, child in state.children])
    if state.config is not None:
        vars(model)[_MODEL_ATTR] = state.config
    if state.record is not None:
        setattr(model.config, CONFIG_KEY, state.record)
        if not hasattr(type(model.config), BASE_TYPE_ATTR):  # a saved folder's own config class saves right already
            model.config.__class__ = _saving_config_class(type(model.config))
        if _PACKAGE["atomic_save"] is not None:
            vars(model)["save_pretrained"] = _PACKAGE["atomic_save"](model)  # writes never destroy (destinations.py)
    if state.config is not None:
        _mark(model, state.config)


# What a patched model names as its base: transformers' `model.name_or_path` (set from the config in
# PreTrainedModel.__init__), which PEFT writes into every adapter saved from the model (adapter_config.json's
# base_model_name_or_path). AutoPeftModel, pipeline(model=adapter) and transformers' adapter loading load that base
# and put the adapter on it: for an adapter trained on the patched model, the unpatched base, silently. This text is
# no folder and no valid repo id, so they refuse it (huggingface_hub checks the id before any request) with the text
# in their error. config._name_or_path, which savers and cards read, stays the base's.
PATCHED_BASE_NAME = ("hf_tangent patched model: load its adapters with PeftModel.from_pretrained(hf_tangent.patch(base, "
                     "training_cfg), folder), or save with hf_tangent.save_patch(peft_model, folder) and load with "
                     "hf_tangent.from_pretrained(folder)")
_PRIOR_ATTR = "_hf_tangent_prior"  # what _mark changed: name_or_path and model_tags as they were, the tags before, added


def _mark(model, config: TangentConfig) -> None:
    """Name the patched model PATCHED_BASE_NAME and tag it (`model_tags`, which push_to_hub's card, the Trainer's,
    TRL's and PEFT's adapter cards read) with hf_tangent and its rule."""
    own = vars(model)
    tags = list(getattr(model, "model_tags", None) or [])  # a new list: a class-level one is never appended to
    added = [tag for tag in ("hf_tangent", f"hf_tangent-{config.update}") if tag not in tags]
    own[_PRIOR_ATTR] = ({key: (key in own, own.get(key)) for key in ("name_or_path", "model_tags")}, tags, added)
    own["name_or_path"], own["model_tags"] = PATCHED_BASE_NAME, tags + added


def _unmark(model) -> None:
    """Undo _mark exactly; tags added to the model since (TRL's, push_to_hub(tags=)'s) stay."""
    own = vars(model)
    if _PRIOR_ATTR not in own:
        return
    prior, tags, added = own.pop(_PRIOR_ATTR)
    current = own.get("model_tags") or []
    if any(tag not in tags and tag not in added for tag in current):
        prior["model_tags"] = (True, [tag for tag in current if tag not in added])
    for key, (present, value) in prior.items():
        if present:
            own[key] = value
        else:
            own.pop(key, None)


# ----------------------------------------------------------------------------- what a save writes
_SAVES_PATCHED = "_hf_tangent_saves_patched"
_SAVING_CLASSES: dict[type, type] = {}  # config class -> its subclass below (immutable once made)


def _saving_config_class(base: type) -> type:
    """The class of a patched model's (private) config: the model's own config class, except that
    `save_pretrained` writes the patched folder format (hub.write_patched_format: a model_type and
    architecture of its own, remote code), so that `model.save_pretrained`, `push_to_hub` and Trainer
    checkpoints of a patched model never write a folder that loads as its unpatched base. Same name
    as the base class (transformers' auto classes look configs up by name); `to_dict` is unchanged,
    so PEFT and generation read the base model_type. Unpatching restores the base class."""
    cls = _SAVING_CLASSES.get(base)
    if cls is None:
        cls = _SAVING_CLASSES[base] = type(base.__name__, (base,), {
            "__module__": base.__module__, "__qualname__": base.__qualname__, _SAVES_PATCHED: True,
            "save_pretrained": _save_patched_config, "__reduce_ex__": _reduce_saving_config})
    return cls


# What turns a saved config.json into the patched folder format: hub.write_patched_format, registered by
# hub.py when it is imported (hf_tangent's __init__ imports it; the remote code never needs it: its config
# class saves right already). Unregistered, a save refuses rather than writing a folder that loads as its base.
_PATCHED_FORMAT_WRITER: list = []


def register_patched_format(writer) -> None:
    """`writer(folder, config)`: rewrite the config.json a patched model's config just wrote (hub.py)."""
    _PATCHED_FORMAT_WRITER[:] = [writer]


def _save_patched_config(self, save_directory, push_to_hub: bool = False, **kwargs):
    if not _PATCHED_FORMAT_WRITER:
        raise RuntimeError("hf_tangent: the patched folder format is not registered (import hf_tangent, which "
                           "registers it) — a plain save would load as the unpatched base.")
    write_patched_format = _PATCHED_FORMAT_WRITER[0]
    if push_to_hub:  # push_to_hub saves into a folder of its own, through this method, then uploads
        return self.push_to_hub(kwargs.pop("repo_id", os.path.basename(os.path.normpath(save_directory))), **kwargs)
    type(self).__mro__[1].save_pretrained(self, save_directory, **kwargs)
    write_patched_format(save_directory, self)


def _reduce_saving_config(self, protocol):
    return _rebuild_saving_config, (type(self).__mro__[1], dict(vars(self)))


def _rebuild_saving_config(base: type, state: dict):
    config = object.__new__(_saving_config_class(base))
    vars(config).update(state)
    return config


def _own_config(model) -> list[tuple[nn.Module, str, object]]:
    """Give the model a private copy of its transformers config (models built from one config
    object share it, and the patch record must belong to one model). Returns what was replaced."""
    old = model.config
    if vars(model).get(_OWN_CONFIG_ATTR) is old:
        return []
    memo: dict = {}
    new = copy.deepcopy(old, memo)
    replaced = []
    for module in model.modules():  # every module that holds the config (or a sub-config) by reference
        for name, value in list(vars(module).items()):
            if id(value) in memo and memo[id(value)] is not value and hasattr(value, "to_json_string"):
                replaced.append((module, name, value))
                vars(module)[name] = memo[id(value)]
    vars(model)[_OWN_CONFIG_ATTR] = new
    return replaced


def _restore_config(model, replaced) -> None:
    for module, name, value in replaced:
        vars(module)[name] = value
    if replaced:
        vars(model).pop(_OWN_CONFIG_ATTR, None)


# ----------------------------------------------------------------------------- public API
def patch(model, config: TangentConfig):
    """Patch `model` in place with a frozen copy of `config` and return it.

    Patching again replaces the patch. The call is atomic: if anything is wrong (the model, the
    config, a layer), it raises and the model keeps its previous patch, gate values included.
    """
    if _owner(model) is not None:
        return _delegate(model, "patch", _as_owner_config(_owner(model), config))
    return _patch(model, config, verify=True)


def patch_saved(model, config: TangentConfig):
    """`patch` without the verification probe, for a model built from a saved patch record (verified when it
    was saved) inside an engine where a probe forward cannot run: vLLM's Transformers backend, whose
    attention needs the engine's forward context. The spec must be known without a probe: the registry's, or
    the one the saved record carries."""
    if get_registered(model) is None:
        raise ValueError(f"hf_tangent: {type(model).__name__} has no registry entry and no saved spec, so its "
                         "architecture must be discovered and verified by a probe forward, which cannot run here.")
    return _patch(model, config, verify=False)


def _patch(model, config: TangentConfig, *, verify: bool):
    if not isinstance(config, TangentConfig):
        if type(config).__name__ != "TangentConfig" or not hasattr(config, "to_dict"):
            raise TypeError(f"hf_tangent.patch expects a TangentConfig, got {type(config).__name__}.")
        config = TangentConfig.from_dict(config.to_dict(), strict=True)  # another copy's class (remote code)
    config = config.frozen_copy()  # validated again: fields set after construction are checked too
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
    verification = _verify(model, spec, layers, config, updated, parallel) if verify else None
    children = []
    for i in sorted(updated | parallel):
        child = TangentLayer(config, i, update=i in updated, parallel=i in parallel)
        child.prepare(spec, layers[i], exact_in_training=verification is None or verification.ffn_in_training[i])
        children.append((layers[i], child))
    record = {"config": config.to_dict(), "model_type": base_model_type(model.config), "num_layers": num_layers,
              "patched_layers": sorted(updated), "parallel_layers": sorted(parallel), "architecture": spec.to_dict(),
              "base_architecture": model_class(model).__name__.removeprefix(PATCHED_CLASS_PREFIX)}
    _commit(model, _PatchState(children, config, record))
    return model


def _commit(model, new: _PatchState) -> None:
    previous = _snapshot(model)
    replaced = []
    try:
        _remove(model, previous)
        replaced = _own_config(model)
        _apply(model, new)
    except BaseException:
        _remove(model, _snapshot(model))
        _restore_config(model, replaced)
        _apply(model, previous)
        raise


def unpatch(model):
    """Remove the patch (also through PEFT/DDP wrappers): outputs are bit-identical to the model
    before `patch`. Returns the model as passed."""
    base = require_model(model, "unpatch")
    if _owner(base) is not None:
        return _delegate(model, "unpatch")
    _refuse_inside_disabled(base, "unpatch")
    _remove(base, _snapshot(base))
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
    homotopy = getattr(base.config, CONFIG_KEY, {}).get("homotopy")
    if homotopy is not None and isinstance(get_homotopy(base), dict):  # per layer: the layers must stay the same
        layers = len(architecture_layers(base))
        before = sorted(set(current.resolve_layers(layers)) | set(current.resolve_parallel_layers(layers)))
        after = sorted(set(new.resolve_layers(layers)) | set(new.resolve_parallel_layers(layers)))
        if before != after:
            raise ValueError(f"hf_tangent.update_config: the patch has a per-layer homotopy lambda on layers {before}; "
                             f"the change patches layers {after}, which would leave layers without their lambda. "
                             "Set one lambda with hf_tangent.set_homotopy(model, value) first, or keep the layers.")
    lambdas = get_homotopy(base)
    if homotopy is not None:  # refused here, before the model changes
        parallel = new.resolve_parallel_layers(len(architecture_layers(base)))
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


def architecture_layers(base) -> nn.ModuleList:
    return _resolve_spec(base).decoder_layers(base)


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
        _remove(base, _snapshot(base))
        for child, blend in blends:
            child.blend = blend
        _apply(base, state)
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
    with preserved(base):
        _remove(base, _snapshot(base))
        vars(base)[_DISABLED_ATTR] = True
        try:
            yield model
        finally:
            vars(base).pop(_DISABLED_ATTR, None)



HOMOTOPY_SCHEDULES = ("linear", "cosine")
HomotopySchedule = Literal[HOMOTOPY_SCHEDULES]
# set_homotopy's options (and a saved record's homotopy), checked as every option is (core/options.py)
HOMOTOPY_OPTIONS = {"lambda": Option("lambda", float, Range(0, 1)), "schedule": Option("schedule", HomotopySchedule | None),
                    "steps": Option("steps", int | None, Range(0, integer=True))}
_LAMBDA = Option("lambda", float | dict[int, float], Range(0, 1))  # one number, or one per layer


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
    record = getattr(base.config, CONFIG_KEY, None)
    if get_config(base) is None or record is None:
        raise ValueError("hf_tangent.set_homotopy: the model is not patched; use hf_tangent.patch(model, config).")
    children = tangent_layers(base)
    values = _homotopy_values(value, [child.index for child in children])
    HOMOTOPY_OPTIONS["schedule"].check(schedule)
    HOMOTOPY_OPTIONS["steps"].check(steps)
    steps = None if steps is None else int(steps)
    _refuse_fused_blend(get_config(base), [c.index for c in children if c.parallel], values, "set_homotopy")
    for child in children:
        child.blend = values[child.index]
    uniform = len(set(values.values())) <= 1
    saved = next(iter(values.values()), 1.0) if uniform else {str(i): v for i, v in values.items()}
    record["homotopy"] = {"lambda": saved, "schedule": schedule, "steps": steps}
    return model


def _refuse_fused_blend(config: TangentConfig, parallel, values: dict[int, float], call: str) -> None:
    """Fused parallel execution computes the FFN's input projection from the block input in the attention's
    GEMM; lambda < 1 makes the FFN read (1 - lambda) r + lambda h instead, which that GEMM cannot give."""
    if config.parallel_execution != "fused":
        return
    blended = sorted(i for i in parallel if values.get(i, 1.0) != 1.0)
    if blended:
        raise ValueError(f"hf_tangent.{call}: homotopy lambda {[values[i] for i in blended]} on layers {blended}, which "
                         "run with parallel_execution='fused' (one GEMM reads the block input); accepted: lambda 1 "
                         "on those layers, or parallel_execution='hooks' for a blended parallel layer.")


def _homotopy_values(value, layers: list[int]) -> dict[int, float]:
    """{layer: lambda} for every patched layer, from one lambda or a per-layer mapping (checked)."""
    if not isinstance(value, dict):
        _LAMBDA.check(value)  # lambda=1.5 is out of range; accepted: a number >= 0 and <= 1 or a mapping.
        return {i: float(value) for i in layers}
    parsed = {}
    for key, v in value.items():
        index = int(key) if isinstance(key, str) and key.isdigit() else key
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"hf_tangent.set_homotopy: entry {key!r}: {v!r}; accepted: layer index -> number in [0, 1].")
        dataclasses.replace(HOMOTOPY_OPTIONS["lambda"], name=f"lambda[{key!r}]").check(v)
        parsed[int(index)] = float(v)
    if set(parsed) != set(layers):
        raise ValueError(f"hf_tangent.set_homotopy: the mapping gives layers {sorted(parsed)}; accepted: exactly the "
                         f"patched layers {layers}.")
    return parsed


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
