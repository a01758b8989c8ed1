"""hf_tangent: tangential and retraction FFN updates for Hugging Face causal LMs.

    import hf_tangent as ht
    model = ht.patch(model, ht.TangentConfig(update="projected"))

Importing this package patches no model (every patch is per model instance); it registers the PEFT
method `TangentPeftConfig` with PEFT. The recipe API
(`ht.calibrate_gates`, `ht.evaluate_rules`, ...) is imported on first use.
"""

from .analysis.parallel import parallelize
from .artifacts.adapter import TangentPeftConfig
from .artifacts.adapter import register as _register_peft_method
from .artifacts.hub import push_to_hub, save_hub_folder
from .artifacts.loading import from_pretrained
from .artifacts.models import load_model
from .artifacts.patch_repo import push_patch, save_patch
from .artifacts.serialization import from_config, save_pretrained
from .core._version import __version__
from .core.config import TangentConfig
from .core.discovery import describe, register_architecture, supported_model_types
from .core.patching import (
    TangentLayer,
    disabled,
    get_config,
    get_homotopy,
    patch,
    set_homotopy,
    tangent_layers,
    unpatch,
    update_config,
)
from .core.registry import ArchitectureSpec
from .training.data import TextSource

_register_peft_method()  # PEFT takes TangentPeftConfig from here on (artifacts/adapter)

# The Python API of every recipe (hf_tangent.experiments), loaded lazily: it imports the Trainer.
_LAZY = {"evaluate_rules": "experiments", "calibrate_gates": "experiments", "finetune": "experiments",
         "ablate": "experiments", "diagnose_layers": "experiments", "layer_sensitivity": "experiments",
         "parallel_sweep": "experiments", "Report": "reports",
         "TangentTrainingArguments": "training", "gate_values": "training", "heal": "experiments",
         "HealSettings": "experiments", "LoraSettings": "experiments", "HomotopyCallback": "healing", "critical": "experiments",
         "pressure": "experiments", "ffn_jacobian": "experiments", "lm_eval": "experiments",
         "merge_lm_eval": "downstream"}  # downstream: takes reports, not a model


def __getattr__(name: str):
    # imported on first use, not to dodge a cycle: the recipe API imports the Trainer, which `import
    # hf_tangent` (and the command line's --help) should not pay for
    if name in _LAZY:
        if _LAZY[name] == "experiments":
            from . import experiments as module
        elif _LAZY[name] == "reports":
            from .experiments import report as module
        elif _LAZY[name] == "downstream":
            from .experiments import downstream as module
        elif _LAZY[name] == "training":
            from .training import trainer as module
        else:
            from .training import healing as module
        return getattr(module, name)
    raise AttributeError(f"module 'hf_tangent' has no attribute {name!r}")


__all__ = [
    "ArchitectureSpec",
    "TangentConfig",
    "TangentLayer",
    "TangentPeftConfig",
    "TextSource",
    "__version__",
    "disabled",
    "from_config",
    "from_pretrained",
    "get_config",
    "load_model",
    "parallelize",
    "patch",
    "push_to_hub",
    "push_patch",
    "save_patch",
    "register_architecture",
    "describe",
    "set_homotopy",
    "get_homotopy",
    "save_hub_folder",
    "save_pretrained",
    "supported_model_types",
    "tangent_layers",
    "unpatch",
    "update_config",
    *_LAZY,
]
