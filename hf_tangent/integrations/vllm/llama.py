"""vLLM model classes for patched Llama-family folders (Llama, Mistral; SmolLM2 is a Llama).

vLLM's decoder layer returns (y, x): the MLP output and the residual after attention, and the next
layer's fused add + RMSNorm forms x + y. The patched layer returns (x_next - x, x) instead, with
x_next - x from hf_tangent's update rule in float32 (rules.residual_delta), the gate, the homotopy
lambda: the layer's own forward runs unchanged. A parallel-converted layer needs the FFN to read the
block input, so its forward is rewritten (a few lines). The patch comes from the folder's config.json
record, exactly as hf_tangent's own loaders read it.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralDecoderLayer, MistralForCausalLM

from ...core.config import NOISE_UPDATES, TangentConfig
from ...core.rules import residual_delta


def _patch_of(hf_config) -> dict:
    """The checked patch record of the served folder, per layer: {index: (update?, parallel?, lambda)}."""
    record = getattr(hf_config, "hf_tangent", None)
    if not isinstance(record, dict):
        raise ValueError("hf_tangent vLLM plugin: this folder's config.json has no hf_tangent patch record.")
    config = TangentConfig.from_dict(record["config"])
    if "attention" in config.branches and config.update != "add":
        raise ValueError("hf_tangent vLLM plugin: branches=('ffn', 'attention') (the rule on the attention branch too) "
                         "is not served by vLLM; accepted: the FFN branch (serve the model with transformers).")
    layers = hf_config.num_hidden_layers
    patched, parallel = set(config.resolve_layers(layers)), set(config.resolve_parallel_layers(layers))
    if sorted(patched) != sorted(record["patched_layers"]) or sorted(parallel) != sorted(record["parallel_layers"]):
        raise ValueError("hf_tangent vLLM plugin: the record's layers disagree with its config.")
    lam = (record.get("homotopy") or {}).get("lambda", 1.0)
    lambdas = {int(k): float(v) for k, v in lam.items()} if isinstance(lam, dict) else {i: float(lam) for i in patched | parallel}
    return {"config": config, "patched": patched, "parallel": parallel, "lambdas": lambdas}


class _Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)


def _tangent_layer(base: type) -> type:
    """`base` (a vLLM decoder layer class) with the patch of its index applied."""

    class TangentLayer(base):
        def __init__(self, *, vllm_config, prefix: str = "", **kwargs):
            super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
            patch = _patch_of(vllm_config.model_config.hf_config)
            self.index = int(prefix.rsplit(".", 1)[-1])
            self.config = patch["config"]
            self.update = self.index in patch["patched"]
            self.parallel = self.index in patch["parallel"]
            self.blend = patch["lambdas"].get(self.index, 1.0)
            if self.update and self.config.gates:
                self.tangent_patch = _Gate()

        def _delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            c = self.config
            gate = self.tangent_patch.gate if hasattr(self, "tangent_patch") else None
            if c.update in NOISE_UPDATES:  # exactly alpha * y outside training
                delta = (c.alpha * y.float() * (1.0 if gate is None else gate)).to(y.dtype)
            else:
                delta = residual_delta(x, y, c.update, alpha=c.alpha, beta=c.beta, p=c.p, eps=c.eps,
                                       eps_mode=c.eps_mode, gate=gate)
            if self.blend != 1.0:
                delta = torch.lerp(y.float(), delta.float(), self.blend).to(y.dtype)
            return delta

        def forward(self, positions, hidden_states, residual):
            if self.parallel:
                return self._parallel_forward(positions, hidden_states, residual)
            y, x = super().forward(positions, hidden_states, residual)
            return (self._delta(x, y) if self.update else y), x

        def _parallel_forward(self, positions, hidden_states, residual):
            """x + A(N1(h)) + FFN(N2(h)): the FFN reads the block input h (with lambda < 1,
            (1 - lambda) r + lambda h, r the residual after attention)."""
            if residual is None:
                h, normed = hidden_states, self.input_layernorm(hidden_states)
            else:
                normed, h = self.input_layernorm(hidden_states, residual)
            attention = self.self_attn(positions=positions, hidden_states=normed)
            r = h + attention
            source = h if self.blend == 1.0 else torch.lerp(r.float(), h.float(), self.blend).to(h.dtype)
            y = self.mlp(self.post_attention_layernorm(source))
            # the rule refers to the point the FFN reads (hf_tangent's x on a parallel block, docs/core.md)
            return (self._delta(source, y) if self.update else y), r

    TangentLayer.__name__ = TangentLayer.__qualname__ = f"HfTangent{base.__name__}"
    return TangentLayer


class HfTangentLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = "", layer_type: type = LlamaDecoderLayer):
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=_tangent_layer(layer_type))


class HfTangentMistralForCausalLM(MistralForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = "", layer_type: type = MistralDecoderLayer):
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=_tangent_layer(layer_type))
