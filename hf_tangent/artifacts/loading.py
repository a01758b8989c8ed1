"""One loading front: `hf_tangent.from_pretrained` takes a patch repo (patch_repo.py: the base from its
own repo, checked, then patched) or a complete patched folder (serialization.py), and dispatches."""

from __future__ import annotations

import logging
import os

from ..core.destinations import recover
from .offline import needs_hub
from .patch_repo import is_patch_repo, load_patch, read_record
from .serialization import load_patched_folder

__all__ = ["from_pretrained", "is_patch_repo", "read_record"]
logger = logging.getLogger("hf_tangent")


def from_pretrained(path: str | os.PathLike, *, model_class=None, base_model: str | None = None,
                    base_revision: str | None = None, merge: bool = False, skip_base_check: bool = False,
                    base_trust_remote_code: bool = False, **kwargs):
    """Load a patched model: a folder (or hub repo) written by a patched model's `save_pretrained`, or a
    patch repo written by `save_patch` (the base is loaded from its own repo, then patched).

    `path` is the folder or hub id; `model_class` defaults to AutoModelForCausalLM; `kwargs` go to its `from_pretrained`
    (dtype, device_map, attn_implementation, ...; config fields such as use_cache=False apply to the folder's
    config, as transformers applies them). Patch repos only: `base_model` loads the base from
    another id or a local mirror (`base_revision` its revision), `merge=True` merges LoRA adapters into
    the weights, `skip_base_check=True` loads onto a base whose weights and config are not compared
    with the record, `base_trust_remote_code=True` runs the code of the base the record names
    (`trust_remote_code=` is refused for a patch repo). Every mismatch between the record, the saved
    weights and the model raises a ValueError naming the file and field. A local folder whose last
    save was killed is first finished or rolled back (destinations.recover, logged).
    """
    if isinstance(path, (str, os.PathLike)) and os.path.isdir(os.path.dirname(os.path.abspath(path))):
        try:  # a save of this folder that a kill interrupted: finished or rolled back first (logged)
            recover(path, writer="hf_tangent.from_pretrained")
        except OSError as err:  # a folder we may not write: read what is there
            logger.warning("hf_tangent.from_pretrained: could not finish an interrupted save of %s (%s).", path, err)
    with needs_hub(f"ht.from_pretrained({str(path)!r})", "load"):  # a hub id, or a patch repo's base by id
        return _from_pretrained(path, model_class=model_class, base_model=base_model, base_revision=base_revision,
                                merge=merge, skip_base_check=skip_base_check,
                                base_trust_remote_code=base_trust_remote_code, **kwargs)


def _from_pretrained(path, *, model_class, base_model, base_revision, merge, skip_base_check, base_trust_remote_code,
                     **kwargs):
    hub_kwargs = {k: kwargs[k] for k in ("revision", "token", "cache_dir", "local_files_only") if k in kwargs}
    if is_patch_repo(path, **hub_kwargs):
        if model_class is not None:
            raise ValueError("hf_tangent.from_pretrained: model_class= is not accepted for a patch repo; its base class "
                             "is recorded.")
        return load_patch(path, base_model=base_model, base_revision=base_revision, merge=merge,
                          skip_base_check=skip_base_check, base_trust_remote_code=base_trust_remote_code, **kwargs)
    if base_model is not None or base_revision is not None or merge or skip_base_check or base_trust_remote_code:
        if not os.path.isdir(str(path)):  # a hub id: that it holds no patch record may only mean the Hub is not reached
            from transformers.utils import cached_file

            cached_file(str(path), "config.json", **hub_kwargs)  # offline: the Hub's error (needs_hub) before ours
        raise ValueError(f"hf_tangent.from_pretrained: base_model=, base_revision=, merge=, skip_base_check= and "
                         f"base_trust_remote_code= apply to patch repos; {path!s} is a full model folder (its weights "
                         "are in it).")
    return load_patched_folder(path, model_class=model_class, **kwargs)
