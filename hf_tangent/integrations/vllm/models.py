"""vLLM model classes for patched folders: Llama, Mistral (SmolLM2 is a Llama), Qwen 2 / 3, Phi-3,
Gemma 2 / 3 and GPT-2.

Each class is vLLM's own model class; after it is built, every decoder layer becomes a subclass of its
own class (`__class__` swapped, nothing rebuilt) that applies the layer's patch from the folder's
config.json record, exactly as hf_tangent's own loaders read it:

- Llama, Mistral, Qwen, Phi-3, Gemma: vLLM's decoder layer returns (y, x), the FFN output (after Gemma's
  post-FFN norm) and the residual after attention; the next layer's fused add + RMSNorm forms x + y.
  The patched layer runs the layer's own forward and returns (x_next - x, x), x_next - x from
  hf_tangent's update rule in float32 (the config's `implementation`: the default fused.fused_residual_delta,
  tensor ops that inductor fuses when vLLM compiles), the gate and the homotopy lambda.
- With implementation="triton" a layer hands (y, x) on unchanged and the RMSNorm that consumes them (the next
  layer's input norm, or the model's final norm) runs the rule, the residual add and the norm in one kernel
  (core/triton_update.triton_add_rms_norm), where vLLM ran its own fused add + RMSNorm; compiled, that norm
  applies the layer's update (plain tensor ops) and then its own forward (off CUDA implementation="triton" is
  refused at the first forward, as before). Not for a parallel layer, a homotopy lambda,
  a noise rule, a norm of another pipeline stage, or while EAGLE-3 reads the stream between layers.
- GPT-2's block returns x + y itself, so its forward is written out (four lines of vLLM's own).
- A parallel-converted layer needs the FFN to read the block input: that forward is written out too.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
from vllm.model_executor.models.gemma2 import Gemma2ForCausalLM
from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM
from vllm.model_executor.models.gpt2 import GPT2LMHeadModel
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralForCausalLM
from vllm.model_executor.models.phi3 import Phi3ForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.model_executor.models.utils import PPMissingLayer

from ...artifacts.serialization import _check_record
from ...core.config import NOISE_UPDATES, TangentConfig
from ...core.fused import fused_residual_delta
from ...core.install import _homotopy_values
from ...core.rules import residual_delta
from ...core.triton_update import INTERPRET, triton_add_rms_norm, triton_residual_delta


def _patch_of(hf_config) -> dict:
    """The checked patch record of the served folder, read as hf_tangent's own loaders read it (every record
    field type-checked, the config strict, the homotopy over exactly the patched layers): {"config",
    "patched", "parallel", "lambdas": {layer: lambda}}."""
    record = getattr(hf_config, "hf_tangent", None)
    if not isinstance(record, dict):
        raise ValueError("hf_tangent vLLM plugin: this folder's config.json has no hf_tangent patch record.")
    record = _check_record(record, "config.json")
    try:
        config = TangentConfig.from_dict(record["config"], strict=True)
    except ValueError as err:
        raise ValueError(f"hf_tangent vLLM plugin: config.json, field 'hf_tangent.config': {err}") from err
    if "attention" in config.branches and config.update != "add":
        raise ValueError("hf_tangent vLLM plugin: branches=('ffn', 'attention') (the rule on the attention branch too) "
                         "is not served by vLLM; accepted: the FFN branch (serve the model with transformers).")
    layers = hf_config.num_hidden_layers
    patched, parallel = set(config.resolve_layers(layers)), set(config.resolve_parallel_layers(layers))
    if sorted(patched) != sorted(record["patched_layers"]) or sorted(parallel) != sorted(record["parallel_layers"]):
        raise ValueError("hf_tangent vLLM plugin: the record's layers disagree with its config.")
    homotopy = record.get("homotopy") or {}
    lambdas = _homotopy_values(homotopy.get("lambda", 1.0), sorted(patched | parallel))
    return {"config": config, "patched": patched, "parallel": parallel, "lambdas": lambdas}


class _Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)


class _Patch:
    """What every patched layer adds to its vLLM class: the layer's patch and the update it returns."""

    def _set_patch(self, index: int, patch: dict) -> None:
        self.tangent_index = index
        self.tangent_config = patch["config"]
        self.tangent_update = index in patch["patched"]
        self.tangent_parallel = index in patch["parallel"]
        self.tangent_blend = patch["lambdas"].get(index, 1.0)
        self.tangent_handoff = False  # True: (y, x) go on unchanged; the next norm runs the rule (_RuleAddNorm)
        if self.tangent_parallel and getattr(self, "ada_rms_norm_t_cond", None) is not None:
            raise ValueError("hf_tangent vLLM plugin: a parallel-converted layer with Mistral's ada_rms_norm_t_cond "
                             "(time-conditioned FFN input) is not served; accepted: such layers unconverted.")
        if self.tangent_update and self.tangent_config.gates:
            self.tangent_patch = _Gate()  # loaded from the folder's `...layers.N.tangent_patch.gate`

    def _gate(self):
        return self.tangent_patch.gate if hasattr(self, "tangent_patch") else None

    def _delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """What the layer adds: y unpatched; else x_next - x of the rule, blended with y by lambda."""
        if not self.tangent_update:
            return y
        c, gate = self.tangent_config, self._gate()
        if c.update in NOISE_UPDATES:  # exactly alpha * y outside training
            delta = (c.alpha * y.float() * (1.0 if gate is None else gate)).to(y.dtype)
        else:
            rule = {"reference": residual_delta, "triton": triton_residual_delta}.get(c.implementation, fused_residual_delta)
            delta = rule(x, y, c.update, alpha=c.alpha, beta=c.beta, p=c.p, eps=c.eps, eps_mode=c.eps_mode, gate=gate)
        if self.tangent_blend != 1.0:
            delta = torch.lerp(y.float(), delta.float(), self.tangent_blend).to(y.dtype)
        return delta

    def _ffn_source(self, h: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """The point a parallel layer's FFN reads: the block input h; with lambda < 1, (1 - lambda) r + lambda h,
        r the residual after attention (hf_tangent's x on a parallel block, docs/core.md)."""
        return h if self.tangent_blend == 1.0 else torch.lerp(r.float(), h.float(), self.tangent_blend).to(h.dtype)

    def _split_residual(self, hidden_states, residual):
        """(block input h, its normed form): vLLM passes the previous layer's (y, x) for a fused add + norm."""
        if residual is None:
            return hidden_states, self.input_layernorm(hidden_states)
        normed, h = self.input_layernorm(hidden_states, residual)
        return h, normed


class _PreNormLayer(_Patch):
    """Llama, Mistral, Qwen 2 / 3, Phi-3: h -> x = h + A(N1(h)) -> x + mlp(N2(x))."""

    def forward(self, positions, hidden_states, residual, **kwargs):
        if self.tangent_parallel:
            h, normed = self._split_residual(hidden_states, residual)
            # vLLM's own forwards call the attention with these two alone (Mistral's layer takes a t_cond too)
            r = h + self.self_attn(positions=positions, hidden_states=normed)
            source = self._ffn_source(h, r)
            return self._delta(source, self.mlp(self.post_attention_layernorm(source))), r
        y, x = super().forward(positions, hidden_states, residual, **kwargs)
        return (y if self.tangent_handoff else self._delta(x, y)), x


class _SandwichLayer(_Patch):
    """Gemma 2 / 3: x = h + N2(A(N1(h))), y = N4(mlp(N3(x))) (docs/core.md, 'Sandwich norms')."""

    def forward(self, positions, hidden_states, residual, **kwargs):
        if self.tangent_parallel:
            h, normed = self._split_residual(hidden_states, residual)
            r = h + self.post_attention_layernorm(self.self_attn(positions=positions, hidden_states=normed, **kwargs))
            source = self._ffn_source(h, r)
            y = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(source)))
            return self._delta(source, y), r
        y, x = super().forward(positions, hidden_states, residual, **kwargs)
        return (y if self.tangent_handoff else self._delta(x, y)), x


class _RuleAddNorm:
    """The RMSNorm that consumes a handing-on layer's (y, x): x + the layer's update, normed, in one kernel."""

    def forward(self, x, residual=None):  # vLLM's names: x is the layer's FFN output y, residual its x
        layer = self.tangent_after[0]  # a tuple: not a submodule of the norm
        if residual is None or not layer.tangent_handoff:
            return super().forward(x, residual)
        if torch.compiler.is_compiling() or not (x.is_cuda or INTERPRET):  # torch ops inductor fuses
            return super().forward(layer._delta(residual, x), residual)
        c = layer.tangent_config
        return triton_add_rms_norm(residual, x, self.weight, self.variance_epsilon, c.update, alpha=c.alpha,
                                   beta=c.beta, p=c.p, eps=c.eps, eps_mode=c.eps_mode, gate=layer._gate(),
                                   weight_offset=isinstance(self, GemmaRMSNorm))


_NORM_CLASSES: dict[type, type] = {}


def _fusable_norm(norm) -> bool:
    """vLLM's own RMSNorm (full width, with a weight) or GemmaRMSNorm, exactly: the add + norm the kernel does."""
    return type(norm) is GemmaRMSNorm or (type(norm) is RMSNorm and norm.has_weight
                                          and norm.variance_size_override is None)


def _hand_on(layer, norm) -> None:
    """Let `layer` hand (y, x) on to `norm` when its rule runs as the triton kernel (see the module docstring)."""
    c = layer.tangent_config
    if not (isinstance(layer, (_PreNormLayer, _SandwichLayer)) and layer.tangent_update and c.implementation == "triton"
            and not layer.tangent_parallel and layer.tangent_blend == 1.0 and c.update not in NOISE_UPDATES
            and _fusable_norm(norm)):
        return
    base = type(norm)
    if base not in _NORM_CLASSES:
        _NORM_CLASSES[base] = type(f"HfTangent{base.__name__}", (_RuleAddNorm, base), {})
    norm.__class__ = _NORM_CLASSES[base]
    norm.tangent_after = (layer,)
    layer.tangent_handoff = True


class _GPT2Block(_Patch):
    """GPT-2: the block adds y itself, so its forward is vLLM's, with the rule's update in place of y."""

    def forward(self, hidden_states):
        h = hidden_states
        r = h + self.attn(hidden_states=self.ln_1(h))
        source = self._ffn_source(h, r) if self.tangent_parallel else r
        return r + self._delta(source, self.mlp(self.ln_2(source)))


def _patch_layers(layers: nn.ModuleList, hf_config, kind: type, final_norm=None) -> None:
    """Make every decoder layer this process holds a patched layer: its class becomes a subclass of
    (kind, its own class), so vLLM's modules, weights and forward stay as built."""
    patch = _patch_of(hf_config)
    classes: dict[type, type] = {}
    for index, layer in enumerate(layers):
        base = type(layer)
        if isinstance(layer, PPMissingLayer):  # a layer of another pipeline stage
            continue
        if base not in classes:
            classes[base] = type(f"HfTangent{base.__name__}", (kind, base), {})
        layer.__class__ = classes[base]
        layer._set_patch(index, patch)
    for index, layer in enumerate(layers):
        after = layers[index + 1] if index + 1 < len(layers) else None
        norm = final_norm if after is None else getattr(after, "input_layernorm", None)
        if isinstance(layer, _Patch) and norm is not None and not isinstance(after, PPMissingLayer):
            _hand_on(layer, norm)


def _served(base: type, kind: type, layers: str) -> type:
    """vLLM's model class `base` whose decoder layers (at the attribute path `layers`) are patched."""

    def __init__(self, *, vllm_config, prefix: str = "", **kwargs):
        base.__init__(self, vllm_config=vllm_config, prefix=prefix, **kwargs)
        *path, last = layers.split(".")
        parent = self
        for name in path:
            parent = getattr(parent, name)
        _patch_layers(getattr(parent, last), vllm_config.model_config.hf_config, kind, getattr(parent, "norm", None))

    def set_aux_hidden_state_layers(self, layers) -> None:
        base.set_aux_hidden_state_layers(self, layers)
        for layer in self.modules():  # EAGLE-3 reads hidden_states + residual between layers: each hands on x_next - x
            if isinstance(layer, _Patch):
                layer.tangent_handoff = False

    name = f"HfTangent{base.__name__}"
    body = {"__init__": __init__, "__qualname__": name, "__module__": __name__}
    if hasattr(base, "set_aux_hidden_state_layers"):
        body["set_aux_hidden_state_layers"] = set_aux_hidden_state_layers
    return type(name, (base,), body)


# the architecture name hf_tangent's folders carry (HfTangent<base architecture>) -> its class
HfTangentLlamaForCausalLM = _served(LlamaForCausalLM, _PreNormLayer, "model.layers")
HfTangentMistralForCausalLM = _served(MistralForCausalLM, _PreNormLayer, "model.layers")
HfTangentQwen2ForCausalLM = _served(Qwen2ForCausalLM, _PreNormLayer, "model.layers")
HfTangentQwen3ForCausalLM = _served(Qwen3ForCausalLM, _PreNormLayer, "model.layers")
HfTangentPhi3ForCausalLM = _served(Phi3ForCausalLM, _PreNormLayer, "model.layers")
HfTangentGemma2ForCausalLM = _served(Gemma2ForCausalLM, _SandwichLayer, "model.layers")
HfTangentGemma3ForCausalLM = _served(Gemma3ForCausalLM, _SandwichLayer, "model.layers")
HfTangentGPT2LMHeadModel = _served(GPT2LMHeadModel, _GPT2Block, "transformer.h")
