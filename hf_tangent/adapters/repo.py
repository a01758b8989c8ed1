"""Patch repos: a patch shared the way PEFT shares adapters — kilobytes that point at their base model.

A patch repo (a folder, or a Hub repository with the same files):

    hf_tangent_patch.json      the patch record (TangentConfig, layers, parallel layers, homotopy, the
                               architecture spec), the base model (id and revision, or a local path or
                               an offline name, marked as such; model_type, hidden size, layer count,
                               a weight fingerprint) and the format version
    gates.safetensors          the FFN gates, key `layer.<i>`, float32 (1,)            (gates=True)
    adapter/                   PEFT LoRA adapters in PEFT's own format                 (healed with LoRA)
    README.md                  a model card with Hub metadata (base_model, library_name, tags)

`load_patch` (what `ht.from_pretrained` does with a patch repo) loads the base by id and revision,
checks it against the record, patches it, fills the gates, sets the homotopy lambda and loads the
adapters with PEFT. It reads JSON and safetensors only: no code from the repo runs. There is no
`adapter_config.json` at the top of a patch repo, so PEFT's AutoPeftModelForCausalLM refuses it
instead of returning the unpatched base with the adapters; `PeftModel.from_pretrained(patched_base,
repo, subfolder="adapter")` reads the adapters when asked to.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .._version import __version__
from ..config import TangentConfig
from ..patching import CONFIG_KEY, get_config, patch, set_homotopy, tangent_layers
from ..registry import base_model_type, decoder_layers
from ..serialization import _check_record
from ..wrappers import peft_model_of, sharding_engine, unwrap

RECORD_FILE = "hf_tangent_patch.json"
GATES_FILE = "gates.safetensors"
ADAPTER_FOLDER = "adapter"
CARD_FILE = "README.md"
FORMAT = 1  # the patch-repo format this hf_tangent writes and reads
FINGERPRINT = "sha256 over every base parameter's name, shape and first / last 1024 values rounded to bfloat16"


class PatchRepoError(ValueError):
    """A patch repo that cannot be loaded as it is; the message names the file and what is wrong."""


# ----------------------------------------------------------------------------- writing
def fingerprint(model) -> str:
    """A weight fingerprint of the base model (adapters and the patch's own parameters left out; a
    PEFT-wrapped layer's `base_layer` counts as the layer): the same for the checkpoint however it is
    loaded (float32 or bfloat16), different for another checkpoint of the same architecture."""
    digest = hashlib.sha256()
    for name, param in unwrap(model).named_parameters():
        if "lora_" in name or ".tangent_patch." in name:
            continue
        flat = param.detach().reshape(-1)
        sample = torch.cat([flat[:1024], flat[-1024:]]).to(torch.bfloat16).float().cpu()
        digest.update(f"{name.replace('.base_layer', '')}:{tuple(param.shape)}".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


def _base_source(name: str) -> str:
    from ..models import OFFLINE_MODELS

    return "offline" if name in OFFLINE_MODELS else "local" if os.path.isdir(name) else "hub"


def patch_record(model, *, base_model: str | None = None, revision: str | None = None) -> dict:
    """What hf_tangent_patch.json holds for a patched model (optionally wrapped by PEFT or DDP)."""
    base = unwrap(model)
    config = get_config(base)
    if config is None:
        raise ValueError("hf_tangent.save_patch expects a model patched with hf_tangent.patch.")
    name = base_model or str(getattr(base.config, "_name_or_path", "") or "")
    if not name:
        raise ValueError("hf_tangent.save_patch: the model does not say which checkpoint it was loaded from "
                         "(config._name_or_path is empty); pass base_model='hub-id-or-folder'.")
    text = base.config.get_text_config()
    return {"format": FORMAT, "hf_tangent_version": __version__, "patch": getattr(base.config, CONFIG_KEY),
            "base": {"name_or_path": name, "source": _base_source(name),
                     "revision": revision or getattr(base.config, "_commit_hash", None),
                     "model_type": base_model_type(base.config), "architecture": type(base).__name__,
                     "hidden_size": getattr(text, "hidden_size", None), "num_layers": len(decoder_layers(base)),
                     "dtype": str(next(base.parameters()).dtype).replace("torch.", ""),
                     "fingerprint": {"method": FINGERPRINT, "value": fingerprint(model)}},
            "adapters": ADAPTER_FOLDER if peft_model_of(model) is not None else None,
            "gates": GATES_FILE if config.gates else None}


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
                         "before sharding (adapters.repo.patch_record) and write it with write_patch_repo.")
    gates = {c.index: c.gate.detach().float().cpu().reshape(1) for c in tangent_layers(model) if c.gate is not None}
    return write_patch_repo(folder, patch_record(model, base_model=base_model, revision=revision), gates,
                            peft_model_of(model), card)


def write_patch_repo(folder: str | os.PathLike, record: dict, gates: dict, peft_model=None,
                     card: dict | None = None) -> Path:
    """The files of a patch repo from its record (taken before training or sharding: patch_record), the
    gate values ({layer: value}) and the PEFT model whose adapters it carries (None: no adapters);
    staged next to `folder`, moved in at the end."""
    if sorted(gates) != ([i for i in record["patch"]["patched_layers"]] if record["gates"] else []):
        raise ValueError(f"hf_tangent: gates for layers {sorted(gates)} do not match the patch's gated layers.")
    record = dict(record, adapters=ADAPTER_FOLDER if peft_model is not None else None)
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    try:
        if gates:
            from safetensors.torch import save_file

            tensors = {f"layer.{i}": torch.as_tensor(v, dtype=torch.float32).reshape(1).contiguous() for i, v in gates.items()}
            save_file(tensors, str(staging / GATES_FILE), metadata={"format": "hf_tangent_gates"})
        if peft_model is not None:
            peft_model.save_pretrained(staging / ADAPTER_FOLDER)
        (staging / RECORD_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        (staging / CARD_FILE).write_text(_card(record, card or {}), encoding="utf-8")
        staging.chmod(0o755)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _card(record: dict, card: dict) -> str:
    base, config = record["base"], record["patch"]["config"]
    hub_base = base["source"] == "hub"
    meta = ["---", "library_name: hf_tangent"] + ([f"base_model: {base['name_or_path']}"] if hub_base else []) + [
        "tags:", "- hf_tangent", "- tangential-ffn", "- patch"] + (["- peft", "- lora"] if record["adapters"] else []) + ["---"]
    title = card.get("title", f"{config['update']} patch of {base['name_or_path']}")
    load = (f'model = ht.from_pretrained("<this repo>")   # loads {base["name_or_path"]}'
            + (f" at revision {base['revision']}" if base["revision"] else "") + ", then the patch")
    lines = meta + ["", f"# {title}", "",
                    f"An [hf_tangent](https://github.com/hf-tangent/hf_tangent) patch of `{base['name_or_path']}` "
                    f"({base['source']} base, model_type `{base['model_type']}`): the `{config['update']}` update rule "
                    f"on layers {record['patch']['patched_layers']}" + (
                        f", parallel-residual layers {record['patch']['parallel_layers']}" if record["patch"]["parallel_layers"]
                        else "") + (", learned FFN gates" if record["gates"] else "") + (
                        ", LoRA adapters (PEFT format, in `adapter/`)" if record["adapters"] else "")
                    + ". The repository holds the patch only; the base weights come from the base model's own repository.",
                    "", "## Load it", "", "```python", "import hf_tangent as ht", load,
                    'model = ht.from_pretrained("<this repo>", base_model="path/to/a/local/copy")  # a mirror of the base',
                    "```", "",
                    "PEFT alone would load the base without the patch, so the adapters are not at the top of the "
                    "repository and `AutoPeftModelForCausalLM` refuses it. `hf-tangent export --patch <this repo> "
                    "--output FOLDER` writes a complete folder that loads without hf_tangent "
                    "(`trust_remote_code=True`).", "", "## The patch", "", "```json",
                    json.dumps(record["patch"], indent=2, sort_keys=True), "```"]
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
    from ..hub import upload

    return upload(model, repo_id, RECORD_FILE, "hf_tangent.push_patch: {folder} is not a patch folder",
                  lambda m, tmp: save_patch(m, Path(tmp) / "patch", base_model=base_model, revision=revision, card=card),
                  token=token, private=private, commit_message=commit_message)


# ----------------------------------------------------------------------------- reading
def _file(path, name: str, *, required: bool = True, **hub_kwargs) -> str | None:
    from transformers.utils import cached_file

    try:
        return cached_file(str(path), name, _raise_exceptions_for_missing_entries=required, **hub_kwargs)
    except (OSError, ValueError) as err:
        if not required:
            return None
        raise PatchRepoError(f"hf_tangent: {path!s}: {name} could not be read ({err}).") from err


def is_patch_repo(path, **hub_kwargs) -> bool:
    """True when `path` (a folder or a hub repo) holds hf_tangent_patch.json."""
    return _file(path, RECORD_FILE, required=False, **hub_kwargs) is not None


def read_record(path, **hub_kwargs) -> dict:
    """The checked hf_tangent_patch.json of a patch repo."""
    where = _file(path, RECORD_FILE, **hub_kwargs)

    def fail(message):
        raise PatchRepoError(f"hf_tangent: {where}: {message}")

    try:
        with open(where, encoding="utf-8") as f:
            record = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        fail(f"not a valid JSON file ({err}).")
    if not isinstance(record, dict):
        fail(f"must be a JSON object, got {type(record).__name__}.")
    version = record.get("format")
    if not isinstance(version, int) or isinstance(version, bool):
        fail(f"field 'format' must be an integer, got {version!r}.")
    if version > FORMAT:
        fail(f"written by hf_tangent {record.get('hf_tangent_version', '?')} in patch format {version}; this hf_tangent "
             f"({__version__}) reads format {FORMAT}: upgrade hf_tangent.")
    base = record.get("base")
    fields = {"name_or_path": str, "source": str, "model_type": str, "num_layers": int}
    if not isinstance(base, dict) or any(not isinstance(base.get(k), t) for k, t in fields.items()):
        fail(f"field 'base' must hold {', '.join(fields)} (got {base!r}).")
    if base["source"] not in ("hub", "local", "offline"):
        fail(f"field 'base.source'={base['source']!r}; accepted: 'hub', 'local', 'offline'.")
    try:
        _check_record(record.get("patch"), where)
        TangentConfig.from_dict(record["patch"]["config"])
    except ValueError as err:
        raise PatchRepoError(str(err).replace("hf_tangent.from_pretrained: ", "hf_tangent: ")) from None
    for key, expected in (("adapters", ADAPTER_FOLDER), ("gates", GATES_FILE)):
        if record.get(key) not in (None, expected):
            fail(f"field '{key}'={record.get(key)!r}; accepted: {expected!r} or null.")
    return record


def _load_base(base: dict, base_model: str | None, base_revision: str | None, kwargs: dict):
    from transformers import AutoModelForCausalLM

    from ..models import OFFLINE_MODELS, load_model

    name = base_model or base["name_or_path"]
    revision = base_revision if base_model else (base_revision or base.get("revision"))
    try:
        if name in OFFLINE_MODELS:
            return load_model(name, dtype=kwargs.get("dtype"))[0], name
        return AutoModelForCausalLM.from_pretrained(name, revision=revision, **kwargs), name
    except (OSError, RuntimeError, ValueError) as err:
        raise PatchRepoError(f"hf_tangent: the patch's base model {name!r}" + (f" (revision {revision})" if revision else "")
                             + f" could not be loaded ({err}); pass base_model= to load it from a local copy.") from err


def load_patch(path: str | os.PathLike, *, base_model: str | None = None, base_revision: str | None = None,
               merge: bool = False, **kwargs):
    """The base model of a patch repo with the patch applied: gates filled, lambda set, LoRA adapters
    loaded with PEFT (merged into the weights with `merge=True`; else a PeftModel). Every mismatch
    between the record and the base (model type, hidden size, layer count, weight fingerprint) and
    every damaged file is one PatchRepoError; nothing half-loaded is returned.

    Args:
        path: a patch folder or hub repo; base_model: load the base from here instead (a local
            mirror, another id; then the base's revision is `base_revision`, default none).
        kwargs: for the base's from_pretrained (dtype, device_map, attn_implementation; revision and
            token / cache_dir / local_files_only also select the patch repo's own files)."""
    hub_kwargs = {k: kwargs[k] for k in ("token", "cache_dir", "local_files_only") if k in kwargs}
    if "revision" in kwargs:
        hub_kwargs["revision"] = kwargs.pop("revision")  # the patch repo's revision
    record = read_record(path, **hub_kwargs)
    base = record["base"]
    gates = _read_gates(path, record, **hub_kwargs) if record["gates"] else {}
    model, name = _load_base(base, base_model, base_revision, {k: v for k, v in kwargs.items()})
    if get_config(model) is not None:
        raise PatchRepoError(f"hf_tangent: the base model {name!r} is itself patched; a patch repo applies to an "
                             "unpatched checkpoint.")
    problems = []
    found = {"model_type": base_model_type(model.config), "num_layers": len(decoder_layers(model)),
             "hidden_size": getattr(model.config.get_text_config(), "hidden_size", None)}
    for key, value in found.items():
        if base.get(key) is not None and base[key] != value:
            problems.append(f"{key} {base[key]!r} (recorded) vs {value!r} ({name})")
    recorded = (base.get("fingerprint") or {}).get("value")
    if not problems and recorded and recorded != fingerprint(model):
        problems.append(f"the weights differ (fingerprint {recorded[:12]}... recorded for {base['name_or_path']!r}, "
                        f"{fingerprint(model)[:12]}... for {name!r})")
    if problems:
        raise PatchRepoError(f"hf_tangent: {path!s} was made for base {base['name_or_path']!r}, which does not match "
                             f"{name!r}: " + "; ".join(problems) + ".")
    patch_fields = record["patch"]
    patch(model, TangentConfig.from_dict(patch_fields["config"]))
    applied = getattr(model.config, CONFIG_KEY)
    for key in ("patched_layers", "parallel_layers"):
        if sorted(applied[key]) != sorted(patch_fields[key]):
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

    where = _file(path, GATES_FILE, **hub_kwargs)
    gates = {}
    try:
        with safe_open(where, framework="pt") as f:
            for key in f.keys():
                if not key.startswith("layer.") or not key[6:].isdigit():
                    raise PatchRepoError(f"hf_tangent: {where}: unexpected tensor {key!r}; accepted: 'layer.<index>'.")
                value = f.get_tensor(key)
                if value.shape != (1,) or not value.is_floating_point():
                    raise PatchRepoError(f"hf_tangent: {where}: tensor {key!r} must be a floating-point gate of shape "
                                         f"(1,), got {value.dtype} {tuple(value.shape)}.")
                gates[int(key[6:])] = value
    except PatchRepoError:
        raise
    except Exception as err:  # safetensors raises its own error types for damaged files
        raise PatchRepoError(f"hf_tangent: {where}: not a readable safetensors file ({err}).") from err
    return gates


def _load_adapters(model, path, merge: bool, hub_kwargs: dict):
    from peft import PeftModel

    local = Path(str(path))
    try:
        if local.is_dir():
            peft = PeftModel.from_pretrained(model, str(local / ADAPTER_FOLDER), is_trainable=False)
        else:
            peft = PeftModel.from_pretrained(model, str(path), subfolder=ADAPTER_FOLDER, is_trainable=False,
                                             **{k: v for k, v in hub_kwargs.items() if k in ("revision", "token")})
    except Exception as err:  # PEFT: a missing file, a damaged one, or adapters that do not fit the base
        raise PatchRepoError(f"hf_tangent: {path!s}: the LoRA adapters in {ADAPTER_FOLDER}/ could not be loaded onto "
                             f"the base ({type(err).__name__}: {err}).") from err
    return peft.merge_and_unload() if merge else peft


def export_full_folder(path, output: str | os.PathLike, *, base_model: str | None = None, tokenizer=None, **kwargs):
    """A patch repo as a complete folder (base weights, merged adapters, gates, remote code), for
    users without hf_tangent: `hf-tangent export`."""
    from ..hub import save_hub_folder

    model = load_patch(path, base_model=base_model, merge=True, **kwargs)
    record = read_record(path)
    return save_hub_folder(model, output, tokenizer=tokenizer, card={
        "title": f"{record['patch']['config']['update']} patch of {record['base']['name_or_path']} (exported)",
        "notes": f"Exported from the hf_tangent patch repo `{path}` (LoRA adapters merged)."})
