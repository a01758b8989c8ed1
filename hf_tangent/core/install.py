"""Installing a patch on a model and taking it off, as one state: what a saved folder's remote code needs
to apply the patch its record describes (the public operations on a patched model are patching.py's,
which no folder ships).

A layer's forward is never replaced. Each selected decoder layer gets a child module
`tangent_patch` (a `TangentLayer`) whose hooks sit on the layer and its own submodules:

    input_norm  pre-hook   remember the block input            (parallel conversion, attention branch)
    ffn_norm    pre-hook   remember x; feed the block input    (parallel conversion only)
    ffn_out     hook       return x_next - x, so the layer's own `residual + out` is x_next

What a pre-hook hands the hook after it is stored under the calling thread's key and popped by that
hook: two threads running one model never see each other's x, and nothing outlives the call. Nothing
else runs per call; the model is checked, and its layers verified numerically, when the patch is made.
The gate (if any) is a 1-element parameter of the child, which is called in forward (DeepSpeed ZeRO-3
gathers it; FSDP and ZeRO-3 refuse 0-dim parameters). A patch is built and checked whole before it touches
the model, and the previous patch is put back if anything fails while installing (`_commit`).
The one exception to "hooks only" is the opt-in fused parallel execution (fused_parallel.py, package only).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import warnings

from torch import nn

from .checks import Range, choice, index, number
from .config import TangentConfig
from .layer import TangentLayer
from .registry import (
    BASE_TYPE_ATTR,
    CONFIG_KEY,
    PATCHED_CLASS_PREFIX,
    ArchitectureSpec,
    base_model_type,
    get_registered,
)
from .wrappers import unwrap

CHILD_NAME = "tangent_patch"
_MODEL_ATTR = "_hf_tangent_config"
_OWN_CONFIG_ATTR = "_hf_tangent_own_config"  # the model's private transformers config

# What the installed package adds (hf_tangent/core/__init__.py registers it). A saved folder's remote code ships
# neither discovery.py nor destinations.py: it patches a model its own `__init__` just built, from the spec its
# record saved (verified when it was saved), and its model saves the way transformers saves.
_PACKAGE = {"checked_spec": None, "verify": None, "atomic_save": None, "saving_config_class": None}


def register_package(**package) -> None:
    for name, value in package.items():
        if name not in _PACKAGE:
            raise TypeError(f"hf_tangent: register_package has no {name!r}; accepted: {', '.join(_PACKAGE)}.")
        _PACKAGE[name] = value


def _resolve_spec(model) -> ArchitectureSpec:
    spec = get_registered(model)
    if spec is None:
        raise ValueError(f"hf_tangent: {type(model).__name__} has no registry entry and no saved spec; its architecture "
                         "is discovered by the installed hf_tangent (pip install hf-tangent), not by a folder's remote "
                         "code.")
    return spec


def _check_model(model) -> tuple[ArchitectureSpec, nn.ModuleList]:
    """Everything that can be wrong with the model, checked before anything is changed (the package checks a
    user's model first, discovery.checked_spec; a folder's remote code patches a model its own `__init__` built)."""
    spec = (_PACKAGE["checked_spec"] or _resolve_spec)(model)
    layers = spec.decoder_layers(model)
    for layer in layers:
        for role in ("ffn_norm", "ffn_out"):
            spec.submodule(layer, role)
    return spec, layers


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
    """The model's patch; a record on an unpatched model's config is not its own (a patched folder's config before
    the patch is applied, a config shared with a patched model): no state of this model, left alone."""
    ours = _MODEL_ATTR in vars(model)
    return _PatchState(_patched_layers(model), vars(model).get(_MODEL_ATTR),
                       getattr(model.config, CONFIG_KEY, None) if ours else None)


def _remove(model, state: _PatchState) -> None:
    _unmark(model)
    for layer, child in state.children:
        child.uninstall(layer)
        if layer._modules.get(CHILD_NAME) is child:
            del layer._modules[CHILD_NAME]
    vars(model).pop(_MODEL_ATTR, None)
    if state.record is not None:
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
        if not hasattr(type(model.config), BASE_TYPE_ATTR) and not hasattr(type(model.config), _SAVES_PATCHED):
            # (a saved folder's own config class saves right already; a saving class is not wrapped again)
            model.config.__class__ = _PACKAGE["saving_config_class"](type(model.config))
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
_SAVES_PATCHED = "_hf_tangent_saves_patched"  # set on the config class artifacts/hub.py's saving_config_class makes


def _rebuild_saving_config(base: type, state: dict):
    """A patched model's config from a pickle (the saving class's __reduce_ex__; here since 0.4.0 pickles name it)."""
    config = object.__new__(_PACKAGE["saving_config_class"](base))
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

# Which copy of these modules owns a config of this class (patching._owner reads it on another copy's class):
# transformers 4.x may import a folder's remote code again (another folder of the same name), and the classes of
# the first import then belong to no module in sys.modules.
if "_patching" not in vars(TangentConfig):  # transformers 4.x: a folder of the same name, cached, keeps its owner
    TangentConfig._patching = sys.modules[__name__]


# ----------------------------------------------------------------------------- applying a patch
def patch_saved(model, config: TangentConfig, num_layers: int):
    """`patch` without the verification probe, for a model built from a saved patch record (verified when it
    was saved) inside an engine where a probe forward cannot run: vLLM's Transformers backend, whose
    attention needs the engine's forward context. The spec must be known without a probe: the registry's, or
    the one the saved record carries; the model must have the `num_layers` layers the record was saved for (its
    layers and gates are those layers': a smaller num_hidden_layers would patch others, layers=[-1] for one)."""
    spec = get_registered(model)
    if spec is None:
        raise ValueError(f"hf_tangent: {type(model).__name__} has no registry entry and no saved spec, so its "
                         "architecture must be discovered and verified by a probe forward, which cannot run here.")
    count = len(spec.decoder_layers(model))
    if count != num_layers:
        raise ValueError(f"hf_tangent: this patched model was saved with {num_layers} layers and is built with {count} "
                         "(num_hidden_layers): its patch record and gates describe the saved layers. Accepted: the saved "
                         "layer count, as hf_tangent.from_pretrained accepts.")
    return _patch(model, config, verify=False)


def _patch(model, config: TangentConfig, *, verify: bool):
    if not isinstance(config, TangentConfig):
        if type(config).__name__ != "TangentConfig" or not hasattr(config, "to_dict"):
            raise TypeError(f"hf_tangent.patch expects a TangentConfig, got {type(config).__name__}.")
        config = TangentConfig.from_dict(config.to_dict(), strict=True)  # another copy's class (remote code)
    config = config.frozen_copy()  # validated again: fields set after construction are checked too
    spec, layers = _check_model(model)
    if _PACKAGE["saving_config_class"] is None and not hasattr(type(model.config), BASE_TYPE_ATTR):
        raise ValueError(f"hf_tangent: a folder's remote code patches a model of the folder's own config class (its "
                         f"AutoConfig), which saves the patched format; this {type(model.config).__name__} would save "
                         "as the unpatched base. Build the config with AutoConfig.from_pretrained(folder), or install "
                         "hf_tangent.")
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
    verification = _PACKAGE["verify"](model, spec, layers, config, updated, parallel) if verify else None
    children = []
    for i in sorted(updated | parallel):
        child = TangentLayer(config, i, update=i in updated, parallel=i in parallel)
        child.prepare(spec, layers[i], exact_in_training=verification is None or verification.ffn_in_training[i])
        children.append((layers[i], child))
    record = {"config": config.to_dict(), "model_type": base_model_type(model.config), "num_layers": num_layers,
              "patched_layers": sorted(updated), "parallel_layers": sorted(parallel), "architecture": spec.to_dict(),
              "base_architecture": type(model).__name__.removeprefix(PATCHED_CLASS_PREFIX)}  # (not wrapped: patching.patch)
    _commit(model, _PatchState(children, config, record))
    return model


def _commit(model, new: _PatchState) -> None:
    previous = _snapshot(model)
    replaced = []
    try:  # the model's own config first: a config object the caller holds keeps its record (from_config twice)
        replaced = _own_config(model)
        _remove(model, previous)
        _apply(model, new)
    except BaseException:
        _remove(model, _snapshot(model))
        _restore_config(model, replaced)
        _apply(model, previous)
        raise


HOMOTOPY_SCHEDULES = ("linear", "cosine")
_UNIT = Range(0, 1)
# set_homotopy's options (and a saved record's homotopy): name -> its check (core/checks.py)
HOMOTOPY_OPTIONS = {"lambda": lambda value: number("lambda", value, _UNIT),
                    "schedule": lambda value: choice("schedule", value, HOMOTOPY_SCHEDULES, none=True),
                    "steps": lambda value: number("steps", value, Range(0, integer=True), none=True)}


def set_homotopy(model, value, *, schedule: str | None = None, steps: int | None = None):
    """patching.set_homotopy on the unwrapped model (the saved record's homotopy, applied by the remote code)."""
    base = unwrap(model)
    config, record = vars(base).get(_MODEL_ATTR), getattr(base.config, CONFIG_KEY, None)
    if config is None or record is None:
        raise ValueError("hf_tangent.set_homotopy: the model is not patched; use hf_tangent.patch(model, config).")
    children = [child for _, child in _patched_layers(base)]
    values = _homotopy_values(value, [child.index for child in children])
    schedule, steps = HOMOTOPY_OPTIONS["schedule"](schedule), HOMOTOPY_OPTIONS["steps"](steps)
    _refuse_fused_blend(config, [c.index for c in children if c.parallel], values, "set_homotopy")
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
        number("lambda", value, _UNIT, accepted=f"{_UNIT.describe()} or a mapping")  # one lambda, or one per layer
        return {i: float(value) for i in layers}
    parsed = {}
    for key, v in value.items():
        layer = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else index(key)  # JSON's "3"
        if layer is None or layer in parsed:  # (not "٣"); an int, numpy's int64 too
            raise ValueError(f"hf_tangent.set_homotopy: entry {key!r}: {v!r}; accepted: layer index -> number in [0, 1], "
                             "each layer once.")
        parsed[layer] = float(number(f"lambda[{key!r}]", v, _UNIT))
    if set(parsed) != set(layers):
        raise ValueError(f"hf_tangent.set_homotopy: the mapping gives layers {sorted(parsed)}; accepted: exactly the "
                         f"patched layers {layers}.")
    return parsed
