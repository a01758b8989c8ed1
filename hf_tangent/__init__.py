"""hf_tangent: tangential and retraction FFN updates for Hugging Face causal LMs.

    import hf_tangent as ht
    model = ht.patch(model, ht.TangentConfig(update="projected"))

Importing this package changes nothing: every patch is per model instance.
"""

from ._version import __version__
from .config import TangentConfig
from .hub import push_to_hub, save_hub_folder
from .models import load_model
from .parallel import parallelize
from .patching import TangentLayer, get_config, patch, tangent_layers, unpatch, update_config
from .registry import ArchitectureSpec, register_architecture, supported_model_types
from .serialization import from_config, from_pretrained, save_pretrained

__all__ = [
    "ArchitectureSpec",
    "TangentConfig",
    "TangentLayer",
    "__version__",
    "from_config",
    "from_pretrained",
    "get_config",
    "load_model",
    "parallelize",
    "patch",
    "push_to_hub",
    "register_architecture",
    "save_hub_folder",
    "save_pretrained",
    "supported_model_types",
    "tangent_layers",
    "unpatch",
    "update_config",
]
