"""Architecture registry: where a decoder's layers and their submodules live, keyed by `model_type`.

Supporting one more architecture is one `register_architecture(...)` call (see the entries at
the bottom). Paths are attribute paths, dotted, relative to the model (layers) or a layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ArchitectureSpec:
    model_type: str
    layers: str  # ModuleList of decoder layers, from the *ForCausalLM model (its base model also works)
    input_norm: str  # its input is the block input (recorded for parallel-residual conversion)
    attention: str
    ffn_norm: str  # its input is the residual x that the FFN update is added to
    mlp: str
    ffn_out: str | None = None  # module whose output the layer adds to the residual; default: mlp
    attention_out: str | None = None  # module whose output is the attention update added; default: attention
    parallel_attr: str | None = None  # layer attribute that is True on a parallel block (GPT-NeoX)
    # Optional fused parallel execution (fused_parallel.py): Linear input projections, relative to the layer.
    fused_attention_in: tuple[str, ...] = ()
    fused_ffn_in: tuple[str, ...] = ()

    @property
    def ffn_out_path(self) -> str:
        return self.ffn_out or self.mlp

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        """The decoder layers of a causal LM or of its base model."""
        head, _, tail = self.layers.partition(".")
        for path in (self.layers, tail):
            layers = _get(model, path) if path else None
            if isinstance(layers, nn.ModuleList):
                return layers
        raise ValueError(
            f"hf_tangent: no decoder layers at '{self.layers}' in this {type(model).__name__} "
            f"(model_type '{self.model_type}'); the model has been restructured or wrapped."
        )

    def submodule(self, layer: nn.Module, role: str) -> nn.Module:
        if role == "ffn_out":
            path = self.ffn_out_path
        elif role == "attention_out":
            path = self.attention_out or self.attention
        else:
            path = getattr(self, role)
        module = _get(layer, path)
        if not isinstance(module, nn.Module):
            raise ValueError(
                f"hf_tangent: {type(layer).__name__} has no submodule '{path}' ({role}) that the "
                f"'{self.model_type}' registry entry expects; the layer was replaced or wrapped."
            )
        return module

    def is_parallel(self, layer: nn.Module) -> bool:
        return bool(self.parallel_attr and getattr(layer, self.parallel_attr, False))


def _get(root: nn.Module, path: str):
    obj = root
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


_REGISTRY: dict[str, ArchitectureSpec] = {}


def register_architecture(spec: ArchitectureSpec | None = None, *, overwrite: bool = False, **fields) -> ArchitectureSpec:
    """Register an architecture, as a spec or as its fields: `register_architecture(model_type=..., ...)`."""
    spec = spec if spec is not None else ArchitectureSpec(**fields)
    if spec.model_type in _REGISTRY and not overwrite:
        raise ValueError(f"hf_tangent: model_type '{spec.model_type}' is already registered; pass overwrite=True.")
    _REGISTRY[spec.model_type] = spec
    return spec


def supported_model_types() -> list[str]:
    """The `model_type`s with a registry entry (built in or added with `register_architecture`), sorted."""
    return sorted(_REGISTRY)


def get_spec(model_type: str) -> ArchitectureSpec:
    try:
        return _REGISTRY[model_type]
    except KeyError:
        raise ValueError(
            f"hf_tangent: model_type '{model_type}' is not supported; supported: "
            f"{', '.join(supported_model_types())}. Add one with hf_tangent.register_architecture(...)."
        ) from None


def architecture(model) -> tuple[ArchitectureSpec, nn.ModuleList]:
    """(spec, decoder layers) of a supported model: the one place a model's architecture is resolved."""
    spec = get_spec(model.config.model_type)
    return spec, spec.decoder_layers(model)


def decoder_layers(model) -> nn.ModuleList:
    """The decoder layers of any supported model."""
    return architecture(model)[1]


_LLAMA_LIKE = dict(layers="model.layers", input_norm="input_layernorm", attention="self_attn",
                   ffn_norm="post_attention_layernorm", mlp="mlp",
                   fused_attention_in=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                   fused_ffn_in=("mlp.gate_proj", "mlp.up_proj"))

register_architecture(model_type="gpt2", layers="transformer.h", input_norm="ln_1", attention="attn",
                      ffn_norm="ln_2", mlp="mlp")
# GPT-NeoX adds post_mlp_dropout(mlp(...)) and post_attention_dropout(attention(...)) to the residual;
# use_parallel_residual is read per layer.
register_architecture(model_type="gpt_neox", layers="gpt_neox.layers", input_norm="input_layernorm",
                      attention="attention", ffn_norm="post_attention_layernorm", mlp="mlp",
                      ffn_out="post_mlp_dropout", attention_out="post_attention_dropout",
                      parallel_attr="use_parallel_residual")
register_architecture(model_type="llama", **_LLAMA_LIKE)
register_architecture(model_type="mistral", **_LLAMA_LIKE)
register_architecture(model_type="qwen2", **_LLAMA_LIKE)
# Gemma 2 normalises the attention and MLP outputs before the residual adds: those norms' outputs are added.
register_architecture(model_type="gemma2", layers="model.layers", input_norm="input_layernorm",
                      attention="self_attn", ffn_norm="pre_feedforward_layernorm", mlp="mlp",
                      ffn_out="post_feedforward_layernorm", attention_out="post_attention_layernorm")
