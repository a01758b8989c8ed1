"""Architecture registry: where a decoder's layers and their submodules live, keyed by `model_type`.

Supporting one more architecture is one `register_architecture(...)` call (discovery.py; the built-in
entries are at the bottom); a `model_type` without an entry is discovered from its module tree (discovery.py).
Every spec, registered or discovered, is verified numerically on the model before it is patched.
Paths are attribute paths, dotted, relative to the model (layers) or a layer; "a|b" means the
first of them that the layer has, "ClassA=a|ClassB=b" the one for the layer's class (hybrids whose
roles differ per layer).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from torch import nn

from .checks import OptionTypeError, RangeError, choice, flag, listed


@dataclass(frozen=True)
class ArchitectureSpec:
    model_type: str
    layers: str  # ModuleList of decoder layers, from the *ForCausalLM model (its base model also works)
    input_norm: str | None  # its input is the block input (recorded for parallel-residual conversion)
    attention: str | None  # None: the mixer could not be located (no parallel conversion, no attention branch)
    ffn_norm: str  # its input is the residual x that the FFN update is added to
    mlp: str | None  # the FFN as one module, mlp(ffn_norm(x)); None when it is not one module (OPT's fc1/fc2)
    ffn_out: str | None = None  # module whose output the layer adds to the residual; default: mlp
    attention_out: str | None = None  # module whose output is the attention update added; default: attention
    parallel_attr: str | None = None  # layer attribute that is True on a parallel block (GPT-NeoX)
    parallel: bool = False  # every layer is a parallel block: out = h + attention(h) + ffn(h) (GPT-J, Phi)
    residual_scale: str | None = None  # layer attribute s in out = r + s * ffn_out(...) (Granite, MiniCPM3)
    # Optional fused parallel execution (fused_parallel.py): Linear input projections, relative to the layer.
    fused_attention_in: tuple[str, ...] = ()
    fused_ffn_in: tuple[str, ...] = ()
    source: Literal["registry", "discovered"] = "registry"

    def __post_init__(self):  # the registry is shared by every model: a bad entry must never get in
        for f in dataclasses.fields(self):
            name, value, where = f.name, getattr(self, f.name), f"ArchitectureSpec.{f.name}"
            if name == "parallel":
                flag(where, value)
            elif name == "source":
                object.__setattr__(self, name, choice(where, value, ("registry", "discovered")))
            elif name.startswith("fused_"):  # kept as tuples, so that a spec is hashable
                object.__setattr__(self, name, listed(where, value, "a list of strings", _path(where, value, many=True)))
            else:
                optional = name not in ("model_type", "layers", "ffn_norm")
                if not (value is None and optional):
                    object.__setattr__(self, name, _path(where, value, optional)(value))
        if self.ffn_out is None and self.mlp is None:
            raise ValueError(f"hf_tangent: the spec of '{self.model_type}' names neither mlp nor ffn_out.")

    @property
    def ffn_out_path(self) -> str:
        return self.ffn_out or self.mlp

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict) -> ArchitectureSpec:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"hf_tangent: unknown ArchitectureSpec fields {unknown}.")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})

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
        if path is None:
            raise ValueError(
                f"hf_tangent: the '{self.model_type}' spec has no {role} role ({self.source}), so this "
                "operation (parallel conversion, attention branch, sensitivity) is not available for it."
            )
        module = next((m for m in (_get(layer, p) for p in _alternatives(path, layer)) if isinstance(m, nn.Module)), None)
        if not isinstance(module, nn.Module):
            raise ValueError(
                f"hf_tangent: {type(layer).__name__} has no submodule '{path}' ({role}) that the "
                f"'{self.model_type}' registry entry expects; the layer was replaced or wrapped."
            )
        return module

    def is_parallel(self, layer: nn.Module) -> bool:
        return self.parallel or bool(self.parallel_attr and getattr(layer, self.parallel_attr, False))

    def scale(self, layer: nn.Module) -> float:
        """s in out = r + s * ffn_out(...); 1.0 without a residual multiplier."""
        if self.residual_scale is None:
            return 1.0
        value = getattr(layer, self.residual_scale, None)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value == 0:
            raise ValueError(f"hf_tangent: {type(layer).__name__}.{self.residual_scale} = {value!r} is not a "
                             f"non-zero number, as the '{self.model_type}' spec's residual_scale must be.")
        return float(value)


def _alternatives(path: str, layer: nn.Module) -> list[str]:
    """'a|b': try a, then b. 'ClassA=a|ClassB=b': the path for this layer's class (discovered hybrids)."""
    found = []
    for option in path.split("|"):
        owner, _, sub = option.rpartition("=")
        if not owner or owner == type(layer).__name__:
            found.append(sub)
    return found


def _path(where: str, whole, optional: bool = False, many: bool = False):
    """The check of an attribute path (a str, never blank), kept as a plain str; `whole` is the value an
    error names (`many`: the list of a fused_* field, whose wrong items listed() reports)."""
    words = "a list of strings" if many else "a string, or None" if optional else "a string"

    def check(value):
        if not isinstance(value, str):
            if many:
                return None
            raise OptionTypeError(where, whole, words)
        if not value.strip():
            raise RangeError(where, whole, f"{words}, never an empty one")
        return str.__str__(value)

    return check


def _get(root: nn.Module, path: str):
    obj = root
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


# A saved patched folder names a model_type and architecture of its own ("hf_tangent_llama",
# "HfTangentLlamaForCausalLM"), so that loaders without hf_tangent's remote code refuse it instead of
# loading the unpatched base; its config class (remote code) names the base type in BASE_TYPE_ATTR.
PATCHED_TYPE_PREFIX = "hf_tangent_"
PATCHED_CLASS_PREFIX = "HfTangent"
BASE_TYPE_ATTR = "hf_tangent_base_model_type"


def base_model_type(config) -> str:
    """The model_type of the architecture under a patch: `config.model_type`, except for the config
    class of a saved patched folder (remote code), which reports its own type."""
    return getattr(type(config), BASE_TYPE_ATTR, None) or config.model_type


_REGISTRY: dict[str, ArchitectureSpec] = {}  # model_type -> spec: the entries below, and discovery.register_architecture's
_DISCOVERED: dict[type, ArchitectureSpec] = {}  # model class -> spec found by discovery.py
CONFIG_KEY = "hf_tangent"  # the patch record in model.config / config.json


def get_registered(model) -> ArchitectureSpec | None:
    """The spec of a model without running anything: its registry entry, the spec discovered for its
    class, or the one saved in its patch record; None when it has to be discovered."""
    model_type = base_model_type(model.config)
    if model_type in _REGISTRY:
        return _REGISTRY[model_type]
    spec = _DISCOVERED.get(type(model))
    if spec is not None and spec.model_type == model_type:
        return spec
    saved = (getattr(model.config, CONFIG_KEY, None) or {}).get("architecture")
    if isinstance(saved, dict) and saved.get("model_type") == model_type:
        return ArchitectureSpec.from_dict(saved)
    return None


_LLAMA_LIKE = dict(layers="model.layers", input_norm="input_layernorm", attention="self_attn",
                   ffn_norm="post_attention_layernorm", mlp="mlp",
                   fused_attention_in=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                   fused_ffn_in=("mlp.gate_proj", "mlp.up_proj"))

_REGISTRY.update((spec.model_type, spec) for spec in (
    ArchitectureSpec(model_type="gpt2", layers="transformer.h", input_norm="ln_1", attention="attn", ffn_norm="ln_2",
                     mlp="mlp"),
    # GPT-NeoX adds post_mlp_dropout(mlp(...)) and post_attention_dropout(attention(...)) to the residual;
    # use_parallel_residual is read per layer.
    ArchitectureSpec(model_type="gpt_neox", layers="gpt_neox.layers", input_norm="input_layernorm",
                     attention="attention", ffn_norm="post_attention_layernorm", mlp="mlp",
                     ffn_out="post_mlp_dropout", attention_out="post_attention_dropout",
                     parallel_attr="use_parallel_residual"),
    *(ArchitectureSpec(model_type=model_type, **_LLAMA_LIKE) for model_type in ("llama", "mistral", "qwen2")),
    # Gemma 2 normalises the attention and MLP outputs before the residual adds: those norms' outputs are added.
    ArchitectureSpec(model_type="gemma2", layers="model.layers", input_norm="input_layernorm", attention="self_attn",
                     ffn_norm="pre_feedforward_layernorm", mlp="mlp", ffn_out="post_feedforward_layernorm",
                     attention_out="post_attention_layernorm"),
))
