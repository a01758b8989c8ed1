"""Reloading a patched model that `model.save_pretrained` wrote.

`save_pretrained` needs no help: the patch's record sits in `model.config` (config.json key
"hf_tangent") and the gates are parameters of the model (keys `...tangent_patch.gate`).
`from_pretrained` loads the base model with transformers, checks that the record fits it,
patches, and restores the gate values that the unpatched model did not take.
"""

from __future__ import annotations

import json
import logging
import os
import re
from contextlib import contextmanager

import torch
from safetensors import safe_open

from .config import TangentConfig
from .patching import CHILD_NAME, CONFIG_KEY, patch, tangent_layers

_GATE_KEY = re.compile(rf"(?:^|\.)(\d+)\.{CHILD_NAME}\.gate$")


def _file(path, name: str, *, required: bool = True, **hub_kwargs) -> str | None:
    """A file of a local folder or of a hub repository (downloaded and cached by transformers)."""
    from transformers.utils import cached_file

    try:
        return cached_file(str(path), name, _raise_exceptions_for_missing_entries=required, **hub_kwargs)
    except (OSError, ValueError) as err:  # ValueError: not a valid repo id either (transformers 4.x)
        if not required:
            return None
        raise ValueError(f"hf_tangent.from_pretrained: {path!s} is not a saved model folder or hub repo ({err}).") from err


def read_patch_record(path: str | os.PathLike, **hub_kwargs) -> dict:
    """The "hf_tangent" record of a saved folder's (or hub repo's) config.json."""
    with open(_file(path, "config.json", **hub_kwargs), encoding="utf-8") as f:
        record = json.load(f).get(CONFIG_KEY)
    if record is None:
        raise ValueError(
            f"hf_tangent.from_pretrained: {path!s} holds no hf_tangent patch (config.json has no "
            f"'{CONFIG_KEY}' entry); load it with transformers' AutoModelForCausalLM.from_pretrained."
        )
    return record


def _saved_gates(path: str | os.PathLike, **hub_kwargs) -> dict[int, torch.Tensor]:
    """Gate values by layer index, read from the folder's safetensors files."""
    index_file = _file(path, "model.safetensors.index.json", required=False, **hub_kwargs)
    if index_file:
        with open(index_file, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = ["model.safetensors"]
    gates = {}
    for name in names:
        with safe_open(_file(path, name, **hub_kwargs), framework="pt") as f:
            for key in f.keys():
                match = _GATE_KEY.search(key)
                if match:
                    gates[int(match.group(1))] = f.get_tensor(key)
    return gates


@contextmanager
def _quiet_transformers_loading():
    # The unpatched model does not know the gate keys and would warn about them; we load them below.
    logger = logging.getLogger("transformers.modeling_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def from_pretrained(path: str | os.PathLike, *, model_class=None, **kwargs):
    """Load a folder (or hub repo) written by a patched model's `save_pretrained`; re-apply its patch.

    `model_class` defaults to AutoModelForCausalLM; `kwargs` go to its `from_pretrained`
    (dtype, device_map, attn_implementation, ...).
    """
    hub_kwargs = {k: kwargs[k] for k in ("revision", "token", "cache_dir", "local_files_only") if k in kwargs}
    record = read_patch_record(path, **hub_kwargs)
    config = TangentConfig.from_dict(record["config"])
    if model_class is None:
        from transformers import AutoModelForCausalLM as model_class
    with _quiet_transformers_loading():
        model, info = model_class.from_pretrained(path, output_loading_info=True, **kwargs)

    problems = []
    if model.config.model_type != record.get("model_type"):
        problems.append(f"it was saved from model_type '{record.get('model_type')}', the folder holds '{model.config.model_type}'")
    from .registry import get_spec

    num_layers = len(get_spec(model.config.model_type).decoder_layers(model))
    if num_layers != record.get("num_layers"):
        problems.append(f"it was saved for {record.get('num_layers')} layers, the model has {num_layers}")
    gates = _saved_gates(path, **hub_kwargs) if config.gates else {}
    if not problems and config.gates and sorted(gates) != sorted(record.get("patched_layers", [])):
        problems.append(f"gates are saved for layers {sorted(gates)}, the patch gates layers {record.get('patched_layers')}")
    leftover = [k for k in info.get("unexpected_keys", []) if not _GATE_KEY.search(k)]
    if problems:
        raise ValueError(f"hf_tangent.from_pretrained: the patch in {path!s} does not match its model: " + "; ".join(problems) + ".")
    if leftover:
        logging.getLogger(__name__).warning("unexpected keys in %s not loaded: %s", path, leftover)

    delattr(model.config, CONFIG_KEY)  # patch() writes it again from the validated config
    patch(model, config)
    with torch.no_grad():
        for child in tangent_layers(model):
            if child.gate is not None:
                child.gate.copy_(gates[child.index].to(child.gate.dtype))
    return model


def from_config(config, tangent_config: TangentConfig, *, model_class=None, **kwargs):
    """A freshly initialised model for a transformers `config`, patched with `tangent_config`:
    the patch applies to a from-scratch model exactly as to a pretrained one."""
    if model_class is None:
        from transformers import AutoModelForCausalLM as model_class
    return patch(model_class.from_config(config, **kwargs), tangent_config)
