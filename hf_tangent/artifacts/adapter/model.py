"""`TangentModel`: the PEFT tuner of `TangentPeftConfig` (what `get_peft_model` builds around a model).

There is no target Linear: injecting the adapter is `hf_tangent.patch(model, config)` after the base
is checked against the adapter's record. The gates move into a per-adapter `ParameterDict` under
PEFT's prefix on each patched layer (`...tangent_patch.peft.hf_tangent_gate.<adapter>`), the key layout
PEFT's save and transformers' `load_adapter` select and rename; the layer reads the same Parameter.
`unload()` is the base bit for bit; `merge_and_unload()` is the patched model (no weight merge for a
non-linear rule), whose `save_pretrained` writes a complete patched folder.
"""

from __future__ import annotations

import contextlib

import torch
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from torch import nn

from ...core.layer import TangentLayer
from ...core.patching import CONFIG_KEY, disabled, get_config, patch, set_homotopy, tangent_layers, unpatch
from ...core.wrappers import unwrap
from .. import patch_repo
from .config import PREFIX

# the child of a patched layer's `tangent_patch` that holds its gate for PEFT, and the gate's name (PEFT's prefix + "gate")
HOLDER, GATES = patch_repo.GATE_KEY.split(".")[-2:]


class GateHolder(nn.Module, BaseTunerLayer):
    """A patched layer's gate as PEFT sees a tuner layer's weights: `hf_tangent_gate[<adapter>]` (the very
    Parameter the layer reads as `gate`)."""

    adapter_layer_names = (GATES,)

    def __init__(self, adapter_name: str, gate: nn.Parameter):
        super().__init__()
        self.hf_tangent_gate = nn.ParameterDict({adapter_name: gate})
        self._active_adapter = adapter_name
        self.merged_adapters = []

    def set_adapter(self, adapter_names, inference_mode: bool = False) -> None:
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        if names != list(self.hf_tangent_gate):
            raise ValueError(f"hf_tangent: a model carries one tangent adapter ({list(self.hf_tangent_gate)}); "
                             f"{adapter_names!r} cannot be made active.")
        self.hf_tangent_gate.requires_grad_(not inference_mode)

    def enable_adapters(self, enabled: bool) -> None:
        # turning the patch off is the model's (every layer's hooks): a holder alone cannot
        raise ValueError("hf_tangent: switch a tangent adapter off with PeftModel.disable_adapter() or "
                         "hf_tangent.disabled(model); transformers' enable_adapters() / disable_adapters() is not "
                         "supported for it.")

    def _move_adapter_to_device_of_base_layer(self, adapter_name: str, device=None) -> None:
        pass  # the gate stays where the patch put it (float32); a holder has no base layer


UNNAMED = "(unnamed model)"  # the record's base name for a model that names none (built from a config)


def _name_of(model) -> str:
    return str(vars(model).get("name_or_path") or getattr(model.config, "_name_or_path", "") or UNNAMED)


class HeldTangentLayer(TangentLayer):
    """A patched layer whose `gate` is its holder's Parameter: loaders (transformers' load_adapter) put a new
    Parameter into the ParameterDict, and the layer must read that one."""

    @property
    def gate(self):
        holder = self._modules[HOLDER]
        return holder.hf_tangent_gate[holder._active_adapter]


def _check_gates(state_dict: dict, gated: set[str]) -> None:
    """A saved adapter's tensors are its gates, each float (1,) and finite, one per gated layer: anything else
    (a missing gate left at 1.0, a NaN, a base weight PEFT would load over the checked base) is refused."""
    keys = set(state_dict)
    problems = [f"{label} {sorted(names)[:4]}" for label, names in (
        ("gates missing:", gated - keys), ("tensors that are no gate of this patch:", keys - gated)) if names]
    for key in sorted(keys & gated):
        value = state_dict[key]
        if tuple(value.shape) != (1,) or not value.is_floating_point() or not torch.isfinite(value).all():
            problems.append(f"{key} must be one finite float, got {value.dtype} {tuple(value.shape)} {value.flatten()[:1]}")
    if problems:
        raise ValueError("hf_tangent: adapter_model.safetensors does not fit the adapter's patch: "
                         + "; ".join(problems) + ".")


class TangentModel(BaseTuner):
    prefix = PREFIX
    tuner_layer_cls = nn.Module  # no tuner layers: the patch's own child modules hold the gates
    target_module_mapping: dict = {}

    def inject_adapter(self, model, adapter_name, autocast_adapter_dtype=True, low_cpu_mem_usage=False,
                       state_dict=None) -> None:
        config = self.peft_config[adapter_name]
        others = [name for name in self.peft_config if name != adapter_name]
        if others or get_config(model) is not None:
            for table in (self.peft_config, getattr(model, "peft_config", None)):  # a refused adapter leaves no config
                if isinstance(table, dict) and table.get(adapter_name) is config:
                    del table[adapter_name]
            raise ValueError(f"hf_tangent: adapter {adapter_name!r} refused: the model already carries an hf_tangent "
                             f"patch ({'adapter ' + repr(others[0]) if others else 'hf_tangent.patch'}); a model takes "
                             "one tangent adapter. unload() (or hf_tangent.unpatch) first.")
        if config.lora is not None:
            raise ValueError(f"hf_tangent: this adapter folder also holds LoRA adapters trained on the patched model "
                             f"(in {config.lora}/), which PEFT would not load with it; load the folder with "
                             "hf_tangent.from_pretrained(folder).")
        saved = config.patch is not None  # an adapter read back (its record is checked), else a new one
        if saved:
            patch_repo.check_base_fields(config.base, patch_repo.ADAPTER_RECORD_FILE)
            patch_repo.check_base({"base": config.base}, model, name=_name_of(model), path="the adapter")
        else:
            config.base = patch_repo.base_record(model, _name_of(model), config.revision)
        config.base_model_name_or_path = config.base_model_name_or_path or config.base["name_or_path"]
        patch(model, config.tangent_config())
        if config.homotopy is not None:
            set_homotopy(model, config.homotopy["lambda"], schedule=config.homotopy.get("schedule"),
                         steps=config.homotopy.get("steps"))
        for child in tangent_layers(model):
            if child.gate is not None:
                gate = child._parameters.pop("gate")
                if saved:  # filled by the load: a gate the file does not fill makes the output NaN, never a silent 1
                    gate.data.fill_(float("nan"))
                child.add_module(HOLDER, GateHolder(adapter_name, gate))
                child.__class__ = HeldTangentLayer
        self._mark_only_adapters_as_trainable(model)
        if config.inference_mode:
            for p in model.parameters():
                p.requires_grad_(False)

    def _mark_only_adapters_as_trainable(self, model: nn.Module) -> None:
        for name, p in model.named_parameters():
            p.requires_grad_(f".{GATES}." in name)

    @classmethod
    def _get_adapter_state_dict(cls, model, config, adapter_name, state_dict, unwanted_adapter_names):
        base = unwrap(model)
        live = get_config(base)
        if live is None:
            raise ValueError("hf_tangent: the tangent adapter is off (inside disable_adapter(), or unloaded): a save "
                             "now would hold no gates. Save outside the disable_adapter() block.")
        if live != config.tangent_config() or any(c.gate is not None and not isinstance(c, HeldTangentLayer)
                                                   for c in tangent_layers(base)):
            raise ValueError("hf_tangent: the patch was changed (hf_tangent.update_config or patch) after the tangent "
                             "adapter was made, and an adapter saves its own config: make a new adapter "
                             "(get_peft_model(base, TangentPeftConfig(...))), or save the patched model with "
                             "hf_tangent.save_patch.")
        config.homotopy = (getattr(base.config, CONFIG_KEY, None) or {}).get("homotopy")  # the patch as it is now
        return super()._get_adapter_state_dict(model, config, adapter_name, state_dict, unwanted_adapter_names)

    @classmethod
    def _remap_adapter_state_dict_for_load(cls, model, config, adapter_name, state_dict):
        remapped = super()._remap_adapter_state_dict_for_load(model, config, adapter_name, state_dict)
        gated = {k for k in model.state_dict() if k.endswith(f".{GATES}.{adapter_name}")}
        try:
            _check_gates(remapped, gated)
        except ValueError:  # the caller's base as it was: unpatched, no adapter config
            base = unwrap(model)
            unpatch(base)
            vars(base).pop("peft_config", None)
            raise
        return remapped

    # ------------------------------------------------------------------ PEFT's tuner interface
    def _prepare_adapter_config(self, peft_config, model_config):
        return peft_config

    def _check_target_module_exists(self, peft_config, key):
        return False

    def _create_and_replace(self, *args, **kwargs):
        raise NotImplementedError("hf_tangent patches whole layers; there is no target module to replace.")

    def _cast_adapter_dtype(self, adapter_name: str, autocast_adapter_dtype: bool = True) -> None:
        pass  # gates are float32 (the rule's arithmetic), whatever the model's dtype

    def _enable_adapter_layers(self, enabled: bool = True) -> None:
        holders = self._holders()  # while the patch is on (disabled() takes its layers away)
        if enabled and getattr(self, "_off", None) is not None:
            self._off.close()
            self._off = None
            holders = self._holders()
        elif not enabled and getattr(self, "_off", None) is None:
            self._off = contextlib.ExitStack()
            self._off.enter_context(disabled(self.model))
        for holder in holders:
            holder._disable_adapters = not enabled

    def disable_adapter_layers(self) -> None:
        self._enable_adapter_layers(False)

    def enable_adapter_layers(self) -> None:
        self._enable_adapter_layers(True)

    def set_adapter(self, adapter_name, inference_mode: bool = False) -> None:
        if adapter_name not in (list(self.peft_config), *self.peft_config):
            raise ValueError(f"hf_tangent: no adapter {adapter_name!r}; this model has {list(self.peft_config)}.")
        self.active_adapter = adapter_name

    def _holders(self) -> list[GateHolder]:
        return [m for m in self.model.modules() if isinstance(m, GateHolder)]

    def _release_gates(self) -> None:
        self.enable_adapter_layers()
        for child in tangent_layers(self.model):
            if HOLDER in child._modules:
                gate = child.gate
                del child._modules[HOLDER]
                child.__class__ = TangentLayer
                child.register_parameter("gate", gate)

    def merge_and_unload(self, progressbar: bool = False, safe_merge: bool = False, adapter_names=None):
        """The patched model itself (a non-linear rule merges into no weight): its save is a complete patched folder."""
        self._release_gates()
        return self.model

    def unload(self):
        """The base model, bit for bit as before the adapter."""
        self._release_gates()
        unpatch(self.model)
        return self.model

    def delete_adapter(self, adapter_name: str) -> None:
        self.unload()
        del self.peft_config[adapter_name]

    def _check_merge_allowed(self):
        pass

    def merge_adapter(self, *args, **kwargs) -> None:
        raise ValueError("hf_tangent: a tangent adapter merges into no weight; merge_and_unload() returns the patched "
                         "model, whose save_pretrained writes a complete patched folder.")

    def unmerge_adapter(self) -> None:
        raise ValueError("hf_tangent: a tangent adapter is never merged into weights; nothing to unmerge.")

