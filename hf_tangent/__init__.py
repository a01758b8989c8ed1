"""hf_tangent: tangential and retraction FFN updates for Hugging Face causal LMs.

    import hf_tangent as ht
    model = ht.patch(model, ht.TangentConfig(update="projected"))

Importing this package changes nothing: every patch is per model instance. The recipe API
(`ht.calibrate_gates`, `ht.evaluate_rules`, ...) is imported on first use.
"""

from ._version import __version__
from .adapters import push_patch, save_patch
from .config import TangentConfig
from .data import TextSource
from .discovery import describe
from .hub import push_to_hub, save_hub_folder
from .loading import from_pretrained
from .models import load_model
from .parallel import parallelize
from .patching import (
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
from .registry import ArchitectureSpec, register_architecture, supported_model_types
from .serialization import from_config, save_pretrained

# The Python API of every recipe (hf_tangent.experiments), loaded lazily: it imports the Trainer.
_LAZY = {"evaluate_rules": "experiments", "calibrate_gates": "experiments", "finetune": "experiments",
         "ablate": "experiments", "diagnose_layers": "experiments", "layer_sensitivity": "experiments",
         "parallel_sweep": "experiments", "run_study": "studies", "Report": "reports",
         "TangentTrainingArguments": "training", "gate_values": "training", "heal": "experiments",
         "HealSettings": "experiments", "LoraSettings": "experiments", "HomotopyCallback": "healing", "critical": "experiments",
         "pressure": "experiments", "ffn_jacobian": "experiments", "lm_eval": "experiments"}


def __getattr__(name: str):
    # imported on first use, not to dodge a cycle: the recipe API imports the Trainer, which `import
    # hf_tangent` (and the command line's --help) should not pay for
    if name in _LAZY:
        if _LAZY[name] == "experiments":
            from . import experiments as module
        elif _LAZY[name] == "studies":
            from . import studies as module
        elif _LAZY[name] == "reports":
            from . import reports as module
        elif _LAZY[name] == "training":
            from . import training as module
        else:
            from . import healing as module
        return getattr(module, name)
    raise AttributeError(f"module 'hf_tangent' has no attribute {name!r}")


__all__ = [
    "ArchitectureSpec",
    "TangentConfig",
    "TangentLayer",
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
