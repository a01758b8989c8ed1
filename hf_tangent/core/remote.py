"""What the generated remote code of a patched folder runs (artifacts/hub.py writes the two small files
that call it): the patched config and model classes are the base's own classes under hf_tangent's
model_type, so whatever transformers does per `model_type` or per class name has to be done for those
names too.

transformers 5 loads and saves weights through a conversion table keyed on the class name and the
`model_type` (key renames such as GPT-NeoX's `embed_out` -> `lm_head`, experts fused into one tensor
for MoE families), and skips it for custom code whose names were not registered. A folder holds the
weights in the base's checkpoint layout (the base's save converted them back), so the patched names
get exactly the base's entries: the same conversions on load, and on a save through the remote code.
transformers 4.x has no such table (per-class key maps there are class attributes, which the subclass
inherits).
"""

from __future__ import annotations

from ._version import __version__
from .config import TangentConfig
from .install import CHILD_NAME, CONFIG_KEY, patch_saved, set_homotopy
from .layer import _KERNEL_LOADERS


def _installed():
    """The installed hf_tangent's `init_patched` where it is this folder's release or a newer one: the model's
    patch is then that package's own, so every hf_tangent function works on it and its saves are staged (a
    user's folder or the base refused). None where it is older, unreadable or not installed: this copy patches the
    model, which saves the way transformers saves. (`check_loaded` is always the copy's own: an installed release
    of the same version number may be older, with another signature.)"""
    if __package__ == "hf_tangent.core":  # the package itself (the vLLM plugin imports this module)
        return None
    try:
        from packaging.version import Version

        import hf_tangent.core.remote

        if Version(hf_tangent.core._version.__version__) < Version(__version__):
            return None
        return hf_tangent.core.remote.init_patched
    except Exception:  # not installed, or a release this copy cannot read: the copy's own behaviour
        return None


_INSTALLED = _installed()


def register_conversions(patched_class: str, base_class: str, patched_type: str, base_type: str) -> None:
    """Give the patched class name and model_type the conversion entries transformers keeps for the
    base's class name and model_type (none on transformers 4.x, none where the base has none)."""
    try:
        from transformers.conversion_mapping import (
            get_checkpoint_conversion_mapping,
            register_checkpoint_conversion_mapping,
        )
    except ImportError:  # transformers 4.x
        return
    for patched, base in ((patched_class, base_class), (patched_type, base_type)):
        mapping = get_checkpoint_conversion_mapping(base)
        if mapping is not None:
            register_checkpoint_conversion_mapping(patched, mapping, overwrite=True)


def init_patched(model, config) -> None:
    """The patch a saved record describes, applied in the model's `__init__` (which creates the gates that
    from_pretrained then fills) from the spec the record saved (verified when it was saved): no probe forward,
    which cannot run there (meta weights; vLLM's attention needs the engine's forward context)."""
    if _INSTALLED is not None:
        return _INSTALLED(model, config)
    record = getattr(config, CONFIG_KEY, config)
    if record is config:  # no entry: a model unpatched before it was saved through this code, loaded as it is
        return
    homotopy = record.get("homotopy") if isinstance(record, dict) else None
    if not (isinstance(record, dict) and isinstance(record.get("config"), dict) and type(record.get("num_layers")) is int
            and (homotopy is None or isinstance(homotopy, dict) and "lambda" in homotopy)):  # never the base, gates dropped
        raise ValueError(f"hf_tangent: this patched model's config holds {record!r:.80} under '{CONFIG_KEY}'; accepted: "
                         "the patch record hf_tangent saved (a mapping whose 'config' is a mapping, 'num_layers' an "
                         "integer, and 'homotopy', if any, a mapping with a 'lambda').")
    fields = dict(record["config"])
    implementation = fields.get("implementation")
    if implementation == "triton" or implementation == "reference" and implementation not in _KERNEL_LOADERS:
        fields["implementation"] = "fused"  # a CUDA kernel; the reference a folder's copy lacks: the same rule
    patch_saved(model, TangentConfig.from_dict(fields, strict=True), record["num_layers"])
    if homotopy is not None:  # a model saved mid-homotopy (heal)
        set_homotopy(model, homotopy["lambda"], schedule=homotopy.get("schedule"), steps=homotopy.get("steps"))


def check_loaded(info: dict) -> None:
    """from_pretrained's loading info of a patched folder, where transformers only warns. A complete folder holds
    exactly the weights of the model it was saved from (init_patched refuses another layer count): one it lacks (left
    as initialised: a gate, or a layer that a model with unmerged PEFT adapters saved under PEFT's names), one the
    model has no place for (dropped: a gate the record does not make, a PEFT layer of a tied lm_head) and a mis-shaped
    gate (ignore_mismatched_sizes=True) are refused."""
    for problem, keys, result in (
            ("lack", info.get("missing_keys", ()), "not be loaded (left as initialised)"),
            ("hold", info.get("unexpected_keys", ()), "be dropped (the model has no such parameter)"),
            ("hold mis-shaped", [k for k in (k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys", ()))
                                 if f".{CHILD_NAME}." in k], "not be loaded (left as initialised)")):
        if keys:
            keys = sorted(keys)
            raise ValueError(f"hf_tangent: the weights of this patched folder {problem} {len(keys)} parameter(s) "
                             f"({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}), which would {result}: the "
                             "folder is incomplete or was edited, was saved from a model holding unmerged PEFT adapters "
                             "(merge them first: peft_model.merge_and_unload()), or this call's config keywords "
                             "changed the model. Save it again from the patched model (hf_tangent.save_pretrained, or "
                             "hf_tangent.save_hub_folder), or load it with the saved config.")
