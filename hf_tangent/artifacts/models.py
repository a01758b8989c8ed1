"""Loading models by name: the offline SmolLM2-135M default, offline Gemma-3-270M (checkpoints.py), local
folders (patched folders and patch repos are loaded patched), hub ids."""

from __future__ import annotations

import os

import torch
from safetensors import SafetensorError

from ..core.install import CONFIG_KEY
from .checkpoints import (  # noqa: F401  (re-exported: the names users and recipes import from here)
    DEFAULT_MODEL,
    OFFLINE_MODELS,
    OFFLINE_PACKAGES,
    cache_dir,
    gemma3_folder,
    load_offline,
    load_tokenizer,
    offline_folder,
    offline_package,
    smollm2_folder,
)
from .loading import from_pretrained, is_patch_repo, read_record
from .offline import needs_hub
from .serialization import saved_record


def load_model(name: str = DEFAULT_MODEL, *, dtype: torch.dtype | str | None = None, device: str | None = None,
               **kwargs):
    """(model, tokenizer) for an offline name, a local folder (patched folders and patch repos are loaded
    patched) or a hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    kwargs = {"dtype": dtype or torch.float32, **kwargs}
    if name in OFFLINE_MODELS:
        model = load_offline(name, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(offline_folder(name))
    else:
        source, trust = name, kwargs.get("trust_remote_code")  # the tokenizer's: transformers asks where None
        if os.path.isdir(name) and is_patch_repo(name):  # the tokenizer is the base's
            model = from_pretrained(name, **kwargs)
            base = read_record(name)["base"]["name_or_path"]
            source = str(offline_folder(base)) if base in OFFLINE_MODELS else base
            trust = kwargs.get("base_trust_remote_code") or None
        elif os.path.isdir(name):
            try:
                # a config.json that names a patch (even a null one) is hf_tangent's loader's to read or refuse; a
                # folder without one (a PEFT adapter folder) is transformers'
                config = os.path.join(name, "config.json")
                patched = os.path.lexists(config) and CONFIG_KEY in saved_record(name)[1]
                model = from_pretrained(name, **kwargs) if patched else \
                    AutoModelForCausalLM.from_pretrained(name, **kwargs)
                if patched and trust is None:  # its config names the folder's remote code, which its tokenizer
                    trust = False  # needs not: transformers would ask on stdin (15 s on a terminal)
            except SafetensorError as err:  # not an OSError: the command line would print a traceback
                raise RuntimeError(f"hf_tangent: could not load model '{name}': a weights file is damaged ({err}).") from err
            except OSError as err:  # transformers' words for a damaged config.json or missing weights
                raise RuntimeError(f"hf_tangent: could not load model '{name}': {err}") from err
        else:
            try:
                with needs_hub(f"the model {name!r} (not an offline name nor a local folder: a hub id)", "model"):
                    model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
            except OSError as err:
                raise RuntimeError(
                    f"hf_tangent: could not load model '{name}': it is not an offline name "
                    f"({', '.join(OFFLINE_MODELS)}), not a local folder, and the hub could not serve it ({err})."
                ) from err
        tokenizer = AutoTokenizer.from_pretrained(source, **({} if trust is None else {"trust_remote_code": trust}))
    if device:
        model.to(device)
    return model.eval(), tokenizer
