"""Saving and reloading a patched model (complete folders; patch repos are patch_repo.py).

`model.save_pretrained` needs no help on one process: the patch's record sits in `model.config`
(config.json key "hf_tangent") and the gates are parameters of the model (keys
`...tangent_patch.gate`, float32, shape (1,); releases before 0.2 wrote shape ()). `save_pretrained`
here also gathers a sharded model (FSDP1, FSDP2, ZeRO-3) and writes it on rank 0.

`load_patched_folder` is strict: it checks the record, the weights and the model against each other
in both directions and names every mismatch (file and field) before it returns a model.
"""

from __future__ import annotations

import json
import logging
import os
import re
from contextlib import contextmanager
from pathlib import Path

import torch

from ..core.config import TangentConfig
from ..core.destinations import AtomicSave
from ..core.discovery import architecture
from ..core.gather import full_state_dict
from ..core.install import CHILD_NAME, CONFIG_KEY, HOMOTOPY_OPTIONS
from ..core.patching import get_config, patch, set_homotopy, tangent_layers
from ..core.registry import PATCHED_TYPE_PREFIX, ArchitectureSpec, base_model_type
from ..core.wrappers import unwrap

_GATE_KEY = re.compile(rf"(?:^|\.)(\d+)\.{CHILD_NAME}\.gate$")
_RECORD_FIELDS = {"config": dict, "model_type": str, "num_layers": int, "patched_layers": list, "parallel_layers": list}
_OPTIONAL_RECORD_FIELDS = {"homotopy", "architecture", "base_architecture", "hf_tangent_version"}


def _fail(where, message: str):
    raise ValueError(f"hf_tangent.from_pretrained: {where}: {message}")


# How a complete folder's reader words a file it cannot use ({path}, {name}, {err}, {found}): patch_repo.py words its own
_FOLDER_FILE_ERRORS = (ValueError, {
    "unreadable": "hf_tangent.from_pretrained: {path!s} is not a saved model folder or hub repo ({err}).",
    "not a file": "hf_tangent.from_pretrained: {path!s}: {name} is not a file ({found}).",
    "missing": "hf_tangent.from_pretrained: {path!s} is not a saved model folder or hub repo (no {name})."})


def resolve_file(path, name: str, *, required: bool = True, errors=_FOLDER_FILE_ERRORS, **hub_kwargs) -> str | None:
    """A file of a local folder or of a hub repository (downloaded and cached by transformers), None where it is
    missing and not `required`; `errors`: (the exception class, its messages) of the reader."""
    from transformers.utils import cached_file

    error, messages = errors
    try:
        found = cached_file(str(path), name, _raise_exceptions_for_missing_entries=required, **hub_kwargs)
    except (OSError, ValueError) as err:  # ValueError: not a valid repo id either (transformers 4.x)
        if not required:
            return None
        raise error(messages["unreadable"].format(path=path, name=name, err=err)) from err
    if found is not None and not os.path.isfile(found):
        raise error(messages["not a file"].format(path=path, name=name, found=found))
    if found is None and required:
        raise error(messages["missing"].format(path=path, name=name))
    return found


def _check_record(record, where: str) -> dict:
    if not isinstance(record, dict):
        _fail(where, f"field '{CONFIG_KEY}' must be a mapping, got {type(record).__name__}.")
    for name, kind in _RECORD_FIELDS.items():
        value = record.get(name)
        if name not in record:
            _fail(where, f"field '{CONFIG_KEY}.{name}' is missing.")
        if not isinstance(value, kind) or isinstance(value, bool):
            _fail(where, f"field '{CONFIG_KEY}.{name}' must be a {kind.__name__}, got {value!r}.")
        if kind is list and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
            _fail(where, f"field '{CONFIG_KEY}.{name}' must list layer indices >= 0, got {value!r}.")
    if record["num_layers"] < 1:
        _fail(where, f"field '{CONFIG_KEY}.num_layers' must be >= 1, got {record['num_layers']!r}.")
    unknown = sorted(set(record) - set(_RECORD_FIELDS) - _OPTIONAL_RECORD_FIELDS)
    if unknown:
        _fail(where, f"unknown field(s) {', '.join(f'{CONFIG_KEY}.{k}' for k in unknown)}; accepted: "
                     f"{', '.join(sorted({*_RECORD_FIELDS, *_OPTIONAL_RECORD_FIELDS}))}.")
    homotopy = record.get("homotopy")
    if homotopy is not None:  # set_homotopy's lambda, schedule and steps (optional), checked by its own options
        try:
            if not isinstance(homotopy, dict) or set(homotopy) - set(HOMOTOPY_OPTIONS):
                raise ValueError
            value = homotopy.get("lambda")
            values = list(value.values()) if isinstance(value, dict) and all(
                isinstance(k, str) and k.isdigit() for k in value) else [value]
            for name, given in [*(("lambda", v) for v in values or [None]), ("schedule", homotopy.get("schedule")),
                                ("steps", homotopy.get("steps"))]:
                HOMOTOPY_OPTIONS[name](given)
        except ValueError:
            _fail(where, f"field '{CONFIG_KEY}.homotopy' must be {{'lambda': a number in [0, 1] or {{layer: number}}, "
                         f"'schedule': 'linear' | 'cosine' | null, 'steps': int | null}}, got {homotopy!r}.")
    if "architecture" in record:  # the spec it was patched with (optional: older saves lack it)
        try:
            ArchitectureSpec.from_dict(record["architecture"])
        except (TypeError, ValueError, AttributeError) as err:
            _fail(where, f"field '{CONFIG_KEY}.architecture' is not an architecture spec: {err}")
    return record


def saved_record(path: str | os.PathLike, **hub_kwargs) -> tuple[str, dict, object]:
    """(config.json's path, its contents, its "hf_tangent" record as saved: None where there is none) of a saved
    folder or hub repo; the loaders' one reading of it (destinations.artifact_kind decides what a writer may
    replace)."""
    from transformers import PretrainedConfig

    config_file = resolve_file(path, "config.json", **hub_kwargs)
    try:  # transformers' own reader: it decodes the floats JSON cannot hold ({"__float__": "Infinity"})
        data = PretrainedConfig._dict_from_json_file(config_file)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        _fail(config_file, f"not a valid JSON file ({err}).")
    if not isinstance(data, dict):
        _fail(config_file, f"must be a JSON object (a model's config), got {type(data).__name__}.")
    return config_file, data, data.get(CONFIG_KEY)


def _read_config(path: str | os.PathLike, **hub_kwargs) -> tuple[str, dict, dict]:
    """(config.json's path, its contents, its checked "hf_tangent" record) of a saved folder or hub repo."""
    config_file, data, record = saved_record(path, **hub_kwargs)
    if record is None:
        raise ValueError(
            f"hf_tangent.from_pretrained: {path!s} holds no hf_tangent patch (config.json has no "
            f"'{CONFIG_KEY}' entry{'' if CONFIG_KEY not in data else ', only null'}); load it with transformers' "
            "AutoModelForCausalLM.from_pretrained."
        )
    record = _check_record(record, config_file)
    if data.get("model_type") not in (record["model_type"], PATCHED_TYPE_PREFIX + record["model_type"]):
        _fail(config_file, f"model_type {data.get('model_type')!r} is neither the patch's base model_type "
                           f"{record['model_type']!r} nor its patched form {PATCHED_TYPE_PREFIX + record['model_type']!r}.")
    return config_file, data, record


def transformers_class(name):
    """The transformers model class of that name (a patch's recorded base class: the class a folder's remote
    code subclasses), or None (records before 0.3 name none; a class this transformers version lacks)."""
    import transformers

    cls = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
    return cls if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel) else None


def _base_config(data: dict, record: dict, where: str, model_class, kwargs: dict | None = None):
    """The base model's transformers config from a patched-format config.json (its own model_type
    and remote-code classes replaced by the base's), so the base class loads without remote code; the
    keywords of `kwargs` that name config fields (use_cache=False) are taken out of it and applied, as
    transformers applies them to a config it reads (from_pretrained's dtype stays from_pretrained's)."""
    from transformers import CONFIG_MAPPING

    base_type = record["model_type"]
    config_class = getattr(model_class, "config_class", None)
    if getattr(config_class, "model_type", None) != base_type:
        if base_type not in CONFIG_MAPPING:
            _fail(where, f"the patch's base model_type {base_type!r} is not known to this transformers version; "
                         "upgrade transformers, or load the folder with trust_remote_code=True.")
        config_class = CONFIG_MAPPING[base_type]
    fields = {k: v for k, v in data.items() if k != "auto_map"}
    fields["model_type"] = base_type
    fields["architectures"] = [record["base_architecture"]] if isinstance(record.get("base_architecture"), str) else None
    config = config_class.from_dict(fields)
    given = {k: kwargs.pop(k) for k in list(kwargs or ()) if k not in ("dtype", "torch_dtype") and hasattr(config, k)}
    return config_class.from_dict(fields, **given) if given else config  # (after __init__: rotary_pct stays 0.25)


def _weight_files(path, **hub_kwargs) -> list[str]:
    index_file = resolve_file(path, "model.safetensors.index.json", required=False, **hub_kwargs)
    if not index_file:
        single = resolve_file(path, "model.safetensors", required=False, **hub_kwargs)
        if single is None:
            _fail(path, "no model.safetensors (or index) in the folder; hf_tangent saves safetensors only.")
        return [single]
    try:
        with open(index_file, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
        _fail(index_file, f"not a safetensors index with a 'weight_map' ({err!r}).")
    return [resolve_file(path, name, **hub_kwargs) for name in names]


def _saved_gates(path: str | os.PathLike, **hub_kwargs) -> dict[int, tuple[str, torch.Tensor]]:
    """(file, gate value) by layer index, read from the folder's safetensors files."""
    from safetensors import safe_open

    gates = {}
    for name in _weight_files(path, **hub_kwargs):
        try:
            with safe_open(name, framework="pt") as f:
                for key in f.keys():
                    match = _GATE_KEY.search(key)
                    if match:
                        gates[int(match.group(1))] = (name, key, f.get_tensor(key))
        except Exception as err:  # safetensors raises its own error types for damaged files
            _fail(name, f"not a readable safetensors file ({err}).")
    for name, key, value in gates.values():
        if value.shape not in (torch.Size([]), torch.Size([1])) or not value.is_floating_point():
            _fail(name, f"tensor '{key}' must be a floating-point gate of shape (1,) (or () before 0.2), "
                        f"got {value.dtype} {tuple(value.shape)}.")
        if not torch.isfinite(value).all():
            _fail(name, f"gate '{key}' is {value.reshape(-1)[0].item()}; gates must be finite.")
    return {layer: (name, value) for layer, (name, key, value) in gates.items()}


@contextmanager
def _quiet_transformers_loading():
    # The unpatched model does not know the gate keys and would warn about them; we check them here.
    logger = logging.getLogger("transformers.modeling_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _check_against_model(record: dict, config: TangentConfig, gates: dict, model, info: dict, where: str) -> None:
    """Record <-> model <-> weights, both ways; raises one ValueError naming every mismatch."""
    problems = []
    if base_model_type(model.config) != record["model_type"]:
        problems.append(f"it was saved from model_type '{record['model_type']}', the folder holds "
                        f"'{base_model_type(model.config)}'")
    spec, layers = architecture(model)
    if len(layers) != record["num_layers"]:
        problems.append(f"it was saved for {record['num_layers']} layers, the model has {len(layers)}")
    if problems:
        _fail(where, "the patch does not match its model: " + "; ".join(problems) + ".")
    try:
        patched = list(config.resolve_layers(len(layers)))
        parallel = [i for i in config.resolve_parallel_layers(len(layers)) if not spec.is_parallel(layers[i])]
    except ValueError as err:
        _fail(where, f"field '{CONFIG_KEY}.config': {err}")
    if patched != sorted(record["patched_layers"]):
        problems.append(f"'patched_layers' {record['patched_layers']} disagrees with config.layers "
                        f"{None if config.layers is None else list(config.layers)} (= layers {patched})")
    if parallel != sorted(record["parallel_layers"]):
        problems.append(f"'parallel_layers' {record['parallel_layers']} disagrees with config.parallel_layers "
                        f"{list(config.parallel_layers)} (= layers {parallel})")
    expected = patched if config.gates else []
    if sorted(gates) != expected:
        problems.append(f"gates are saved for layers {sorted(gates)}, the patch gates layers {expected}"
                        + ("" if config.gates else " (config.gates is false)"))
    missing = list(info.get("missing_keys", []))
    unexpected = [k for k in info.get("unexpected_keys", []) if not _GATE_KEY.search(k)]
    mismatched = [k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys", [])]
    for label, keys in (("missing from the weights", missing), ("not in the model", unexpected),
                        ("of the wrong shape", mismatched)):
        if keys:
            problems.append(f"weights {label}: {sorted(keys)[:8]}{' ...' if len(keys) > 8 else ''}")
    if problems:
        _fail(where, "the patch does not match its model: " + "; ".join(problems) + ".")


def load_patched_folder(path: str | os.PathLike, *, model_class=None, **kwargs):
    """A complete patched folder (or hub repo) written by a patched model's `save_pretrained`, loaded and
    patched; `model_class` defaults to AutoModelForCausalLM, `kwargs` go to its `from_pretrained`. Every
    mismatch between the record, the saved weights and the model raises a ValueError naming the file and
    field. (`hf_tangent.from_pretrained`, in loading.py, dispatches between this and patch repos.)"""
    hub_kwargs = {k: kwargs[k] for k in ("revision", "token", "cache_dir", "local_files_only") if k in kwargs}
    _, data, record = _read_config(path, **hub_kwargs)
    where = f"{Path(str(path)) / 'config.json'}"
    try:
        config = TangentConfig.from_dict(record["config"], strict=True)
    except ValueError as err:
        _fail(where, f"field '{CONFIG_KEY}.config': {err}")
    gates = _saved_gates(path, **hub_kwargs)
    if model_class is None:  # the class the remote code subclasses (emu3_text_model has no AutoModelForCausalLM entry)
        from transformers import AutoModelForCausalLM

        model_class = transformers_class(record.get("base_architecture")) or AutoModelForCausalLM
    if data["model_type"] != record["model_type"]:  # the patched format: load the base class, then patch it
        if "config" in kwargs:
            raise ValueError("hf_tangent.from_pretrained: config= is not accepted for a patched folder; its config "
                             "is the folder's own (pass config fields such as attn_implementation as keywords).")
        kwargs = dict(kwargs)
        kwargs["config"] = _base_config(data, record, where, model_class, kwargs)
    try:
        with _quiet_transformers_loading():
            model, info = model_class.from_pretrained(path, output_loading_info=True, **kwargs)
    except (OSError, RuntimeError) as err:
        raise ValueError(f"hf_tangent.from_pretrained: transformers could not load the model in {path!s}: {err}") from err
    _check_against_model(record, config, gates, model, info, where)
    delattr(model.config, CONFIG_KEY)  # patch() writes it again from the validated config
    patch(model, config)
    if record.get("homotopy") is not None:
        set_homotopy(model, record["homotopy"]["lambda"], schedule=record["homotopy"].get("schedule"),
                     steps=record["homotopy"].get("steps"))
    with torch.no_grad():
        for child in tangent_layers(model):
            if child.gate is not None:
                child.gate.copy_(gates[child.index][1].reshape(child.gate.shape).to(child.gate.dtype))
    return model


def save_pretrained(model, folder: str | os.PathLike, *, state_dict=None, **kwargs) -> Path | None:
    """`model.save_pretrained(folder)` that also takes a wrapped or sharded model (PEFT, DDP, FSDP1,
    FSDP2, ZeRO-3): the full state dict is gathered (every rank must call this) and rank 0 writes
    the folder, with the transformers class name (not FSDP2's subclass). Returns the folder on rank 0."""
    refuse_unmerged_adapters(model, "hf_tangent.save_pretrained")  # on every rank, before the collective
    state = full_state_dict(model) if state_dict is None else state_dict  # collective
    if state is None:
        return None
    base = unwrap(model)
    folder = Path(folder)
    save = base.save_pretrained  # a patched model's own: staged, never destroys; a model patched by a folder's
    if get_config(base) is not None and not isinstance(save, AtomicSave):  # copy of the core: transformers' own
        save = AtomicSave(base)
    save(folder, state_dict=state, **kwargs)  # config.json names the class without FSDP2's in-place "FSDP" prefix
    return folder  # (transformers >= 4.57 strips it; a patched folder names its recorded base class)


def refuse_unmerged_adapters(model, writer: str) -> None:
    """A complete folder holds the model's own weights: PEFT's layers (LoRA's base_layer / lora_A, modules_to_save,
    the tangent gates' holder) keep them under names no loader of a complete folder reads (transformers' remote code
    loads such a layer with random weights, only warning), and a learned prompt (prompt tuning, LLaMA-Adapter) is
    no weight of the model (the folder would load without it).
    A Trainer's checkpoint (the model's own save_pretrained) is not refused: it only has to resume."""
    found = sorted({type(m).__name__ for m in model.modules() if hasattr(m, "merged_adapters")}  # in the layers
                   | {type(c).__name__ for m in model.modules() if isinstance(getattr(m, "peft_config", None), dict)
                      for c in m.peft_config.values()  # beside them (merge_and_unload leaves the tangent method's)
                      if getattr(c, "is_prompt_learning", False) or getattr(c, "is_adaption_prompt", False)})
    if found:
        raise ValueError(f"{writer}: the model holds PEFT adapters ({', '.join(found)}), which a complete folder would "
                         "keep under PEFT's names (layers its loaders do not read as the model's weights) or leave out "
                         "(a learned prompt). Accepted: merge LoRA-like adapters first (peft_model.merge_and_unload()), "
                         "or save the adapters with PEFT (peft_model.save_pretrained; LoRA also with "
                         "hf_tangent.save_patch).")


def from_config(config, tangent_config: TangentConfig, *, model_class=None, **kwargs):
    """A freshly initialised model for a transformers `config`, patched with `tangent_config`:
    the patch applies to a from-scratch model exactly as to a pretrained one."""
    if model_class is None:
        from transformers import AutoModelForCausalLM as model_class
    return patch(model_class.from_config(config, **kwargs), tangent_config)
