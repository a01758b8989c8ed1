"""`TangentPeftConfig`: the hf_tangent patch as a PEFT method's config (adapter_config.json).

Constructed with `TangentConfig`'s fields (declared once, there) and PEFT's `task_type`. Saved, the rule
is one field, `patch` (`TangentConfig.to_dict()`, every field), beside what loading it exactly needs: the
base it was made on (`base`: structure, weight fingerprint, computation config), the homotopy lambda,
`lora` (a subfolder of LoRA adapters trained on the patch, written by `ht.save_patch`: PEFT's loaders
refuse such a folder, `ht.from_pretrained` reads it) and the format number. Read back, `patch` must
hold every field (a missing or misspelled one is refused, never a default) and `base` must be there.
"""

from __future__ import annotations

import dataclasses
import typing

from peft import PeftConfig

from ...core.config import TangentConfig, check_fields
from ...core.destinations import ADAPTER_PEFT_TYPE  # its peft_type; PEFT's PeftType enum is closed (__init__.py)
from ...core.options import Range, own_options
from ...core.options import check_fields as check_options
from ..patch_repo import FORMAT, saved_tangent_config

PREFIX = "hf_tangent_"  # PEFT's method prefix: the gates are `<layer>.tangent_patch.peft.hf_tangent_gate.<adapter>`

_HINTS = typing.get_type_hints(TangentConfig)  # the types themselves: their names live in core/config.py
_TANGENT = [(f.name, _HINTS[f.name], dataclasses.field(default=f.default, metadata=f.metadata))
            for f in dataclasses.fields(TangentConfig)]
_SAVED = [
    ("patch", "dict | None", dataclasses.field(default=None, metadata={
        "help": "the rule as saved (TangentConfig.to_dict(), every field); given, the fields above stay unset"})),
    ("base", "dict | None", dataclasses.field(default=None, metadata={
        "help": "the base the adapter was made on (model type, layers, hidden size, weight fingerprint, config "
                "fields that change the computation); filled when the adapter is created, checked when loaded"})),
    ("homotopy", "dict | None", dataclasses.field(default=None, metadata={
        "help": "set_homotopy's lambda (schedule, steps) when saved; None: lambda 1"})),
    ("lora", "typing.Literal['adapter'] | None", dataclasses.field(default=None, metadata={
        "help": "subfolder of LoRA adapters trained on the patch (hf_tangent.save_patch); read by "
                "hf_tangent.from_pretrained, refused by PEFT's loaders"})),
    ("format", "int | None", dataclasses.field(default=None, metadata={
        "help": f"the patch-repo format of a saved adapter ({FORMAT}); a newer one is refused"})),
]

_TANGENT_NAMES = {name for name, _, _ in _TANGENT}


def _post_init(self) -> None:
    # every field's type and range, named as this class: PEFT's fields and the saved ones, then TangentConfig's
    # fields with TangentConfig's checks (which keep lists as tuples: a hand edit beside 'patch' is read before)
    check_options(self, {k: v for k, v in own_options(type(self)).items() if k not in _TANGENT_NAMES},
                  prefix="TangentPeftConfig.")
    given = {f.name: getattr(self, f.name) for f in dataclasses.fields(TangentConfig)}
    check_fields(self, "TangentPeftConfig.")
    if self.peft_type not in (None, ADAPTER_PEFT_TYPE):
        raise ValueError(f"TangentPeftConfig.peft_type={self.peft_type!r}; accepted: None or {ADAPTER_PEFT_TYPE!r}.")
    self.peft_type = ADAPTER_PEFT_TYPE
    PeftConfig.__post_init__(self)
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(TangentConfig)}
    if self.patch is None:
        checked = TangentConfig(**fields)  # the same validation and messages as TangentConfig
    else:  # read from adapter_config.json
        defaults = {f.name: f.default for f in dataclasses.fields(TangentConfig)}
        given = sorted(k for k, v in given.items() if v != defaults[k])  # a JSON list is never the default tuple
        if given:
            raise ValueError(f"TangentPeftConfig: {given} given beside 'patch'; a saved adapter holds its rule in "
                             "'patch' only (a key beside it is a hand edit: put it in 'patch').")
        checked = saved_tangent_config(self.patch, "adapter_config.json: field 'patch'")
        if not isinstance(self.base, dict):
            raise ValueError(f"adapter_config.json: field 'base' must be the base's record (a JSON object), got "
                             f"{self.base!r}.")
        if not isinstance(self.format, int) or isinstance(self.format, bool) or not 3 <= self.format <= FORMAT:
            raise ValueError(f"adapter_config.json: field 'format'={self.format!r}; this hf_tangent reads format 3 to "
                             f"{FORMAT} (a newer format: upgrade hf_tangent).")
    for name in fields:  # normalised as TangentConfig normalises (tuples, p from the retraction)
        object.__setattr__(self, name, getattr(checked, name))
    if self.homotopy is not None and not (isinstance(self.homotopy, dict) and "lambda" in self.homotopy
                                          and set(self.homotopy) <= {"lambda", "schedule", "steps"}):
        raise ValueError(f"TangentPeftConfig.homotopy={self.homotopy!r}; accepted: None or "
                         "{'lambda': ..., 'schedule': ..., 'steps': ...} (set_homotopy's arguments).")
    if self.task_type not in (None, "CAUSAL_LM"):
        raise ValueError(f"TangentPeftConfig.task_type={self.task_type!r}; accepted: 'CAUSAL_LM' or None (the patch "
                         "applies to causal LMs).")


def _tangent_config(self) -> TangentConfig:
    """The `TangentConfig` this adapter applies."""
    return TangentConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(TangentConfig)})


def _to_dict(self) -> dict:
    tangent = {f.name for f in dataclasses.fields(TangentConfig)}
    out = {k: v for k, v in PeftConfig.to_dict(self).items() if k not in tangent}
    return out | {"patch": self.tangent_config().to_dict(), "format": FORMAT}


TangentPeftConfig = dataclasses.make_dataclass(
    "TangentPeftConfig", _TANGENT + _SAVED, bases=(PeftConfig,),
    namespace={"__post_init__": _post_init, "tangent_config": _tangent_config, "to_dict": _to_dict,
               "__module__": __name__, "RANGES": {**TangentConfig.RANGES, "format": Range(3, FORMAT, integer=True)},
               "EMPTY": TangentConfig.EMPTY,
               "__doc__": "An hf_tangent patch as a PEFT method: every `TangentConfig` field, and PEFT's task_type.\n\n"
                          "    model = get_peft_model(base, TangentPeftConfig(update='projected', gates=True))\n"})
