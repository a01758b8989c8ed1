"""Patched folders of families vLLM serves through its Transformers backend (vLLM builds transformers' own
module tree, with its linear layers and attention swapped in): GPT-NeoX (Pythia), which has no vLLM model
class of its own.

hf_tangent's own patch (the hooks around the FFN's modules, the gates) is applied to that tree once vLLM
has replaced its modules, exactly as hf_tangent's loaders apply it to a transformers model; only the
verification probe is skipped (it needs a forward, which vLLM's attention cannot run outside the engine;
the record was verified when it was saved, and the spec comes from hf_tangent's registry).
"""

from __future__ import annotations

from vllm.model_executor.models.transformers import TransformersForCausalLM

from ...artifacts.serialization import _base_config
from ...core.registry import CONFIG_KEY
from ...core.remote import init_patched


class HfTangentTransformersForCausalLM(TransformersForCausalLM):
    def _patch_config(self):
        """The base config (transformers' own class, base architecture) for AutoModel.from_config; the record kept."""
        record = getattr(self.config, CONFIG_KEY, None)
        if not isinstance(record, dict):
            raise ValueError("hf_tangent vLLM plugin: this folder's config.json has no hf_tangent patch record.")
        self.config = _base_config(self.config.to_dict(), record, "config.json", None)  # the config class of the base model_type
        self.text_config = self.config.get_text_config()
        super()._patch_config()

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if self.pp_group.world_size > 1:
            raise ValueError("hf_tangent vLLM plugin: pipeline parallelism is not served for "
                             f"{type(self).__name__}; serve it on one pipeline stage.")
        init_patched(self.model, self.config)  # as the remote code does; the gates: loaded after this


class HfTangentGPTNeoXForCausalLM(HfTangentTransformersForCausalLM):
    pass
