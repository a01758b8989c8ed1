"""`TangentConfig`: what a patch does, validated on construction, round-tripped through JSON.

The defaults reproduce the unpatched model (update="add", alpha=1, no gates, nothing parallel).
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from ._version import __version__
from .checks import Range, RangeError, choice, flag, index, listed, number

UPDATES = ("add", "projected", "soft", "norm_preserving", "radial", "zero", "retract",
           "tangent_noise", "gaussian_noise", "residual_dropout")
# Training-time stochastic updates (math.md section 3): exactly "add" in eval mode.
NOISE_UPDATES = ("tangent_noise", "gaussian_noise", "residual_dropout")
BRANCHES = ("ffn", "attention")
# Named retractions of math.md section 2, as the p of theta_p(t) = p * atan(t / p).
RETRACTIONS = {"proj": 1.0, "cayley": 2.0, "exp": math.inf}
RETRACTION_NAMES = tuple(RETRACTIONS)
EPS_MODES = ("absolute", "relative")
IMPLEMENTATIONS = ("fused", "reference", "triton")
PARALLEL_EXECUTIONS = ("hooks", "fused")
# Bounds that keep every update finite in float32: alpha * y overflows float32 only for |y| > 3.4e32.
MAX_ALPHA = 1e6
MAX_NOISE = 1e3
MAX_EPS = 1e6
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32: a smaller eps rounds to 0


@dataclass
class TangentConfig:
    """Settings of one hf_tangent patch. See docs/math.md for every formula."""

    update: Literal[UPDATES] = field(
        default="add",
        metadata={"help": "FFN update rule: " + ", ".join(UPDATES) + ". 'add' is the unmodified model."},
    )
    beta: float = field(
        default=1.0, metadata={"help": "'soft' only: y - beta*c*x, 0 <= beta <= 1 (1 = hard projection)."}
    )
    p: float | None = field(
        default=None,
        metadata={"help": "'retract' only: angle map theta = p*atan(t/p), p > 0; 1 = projection, "
                          "2 = Cayley, inf = exponential map. Default: the retraction's p, else 1."},
    )
    retraction: Literal[RETRACTION_NAMES] | None = field(
        default=None,
        metadata={"help": "'retract' only: alias for p, one of " + ", ".join(RETRACTIONS) + "."},
    )
    alpha: float = field(
        default=1.0, metadata={"help": f"Residual multiplier: x + alpha * y_used, |alpha| <= {MAX_ALPHA:g}."}
    )
    eps: float = field(
        default=1e-6,
        metadata={"help": "Stabiliser of ||x||^2 + eps (float32); with eps_mode='relative' it is "
                          "eps * mean(||x||^2) over the tokens of the call."},
    )
    eps_mode: Literal[EPS_MODES] = field(default="absolute", metadata={"help": "'absolute' or 'relative' eps."})
    gamma: float = field(
        default=0.0,
        metadata={"help": "noise updates only: tangent noise scale gamma >= 0 (math.md section 3); the gaussian and "
                          "dropout updates inject the same expected noise energy per token."},
    )
    noise_h: float = field(default=0.1, metadata={"help": "noise updates only: step h > 0 of the drift h*p and noise gamma*sqrt(h)*q."})
    noise_rank: int = field(default=4, metadata={"help": "tangent_noise only: rank r of the shared symmetric drift field."})
    branches: tuple[Literal[BRANCHES], ...] = field(
        default=("ffn",),
        metadata={"help": "residual branches the rule applies to: ('ffn',) or ('ffn', 'attention') (GeoNorm style)."},
    )
    layers: tuple[int, ...] | None = field(
        default=None, metadata={"help": "Layer indices to patch (negative allowed); None = every layer."}
    )
    gates: bool = field(
        default=False, metadata={"help": "Learnable scalar FFN gate per patched layer, initialised at 1.0."}
    )
    parallel_layers: tuple[int, ...] = field(
        default=(), metadata={"help": "Layers run in parallel-residual form x + A(x) + FFN(Norm(x))."}
    )
    parallel_execution: Literal[PARALLEL_EXECUTIONS] = field(
        default="hooks",
        metadata={"help": "How parallel_layers run: 'hooks' (the model's own code, default) or 'fused' "
                          "(opt-in: one GEMM for the attention and FFN input projections; llama-like models)."},
    )
    implementation: Literal[IMPLEMENTATIONS] = field(
        default="fused",
        metadata={"help": "'fused': one autograd Function with an analytic backward that saves only x and y "
                          "(default); 'reference': plain tensor ops (rules.py), what the tests compare against; "
                          "'triton': one Triton kernel per rule (CUDA; opt-in, not yet measured on hardware)."},
    )

    # The range of each number (core/checks.py; the command line and the PEFT config read them here too):
    # errors say `TangentConfig.beta=1.5 is out of range; accepted: a number >= 0 and <= 1.`
    RANGES: ClassVar[dict[str, Range]] = {
        "beta": Range(0, 1), "p": Range(0, open_low=True, allow_inf="the exponential map, retraction='exp'"),
        "alpha": Range(-MAX_ALPHA, MAX_ALPHA), "eps": Range(FLOAT32_TINY, MAX_EPS), "gamma": Range(0, MAX_NOISE),
        "noise_h": Range(0, MAX_NOISE, open_low=True), "noise_rank": Range(1, 2**16, integer=True),
        "layers": Range(integer=True), "parallel_layers": Range(integer=True)}  # negative: from the end
    EMPTY: ClassVar[dict[str, str]] = {"layers": "no layer's update rule changed (a config of parallel_layers only)"}

    def __post_init__(self) -> None:
        check_fields(self, "TangentConfig.")
        if self.retraction is not None:
            if self.update != "retract":
                raise ValueError(f"TangentConfig.retraction={self.retraction!r} with update={self.update!r}: a retraction "
                                 "is for update='retract' only; accepted: retraction=None, or update='retract'.")
            implied = RETRACTIONS[self.retraction]
            if self.p is not None and self.p != implied:
                raise ValueError(
                    f"TangentConfig: retraction={self.retraction!r} means p={implied}, but p={self.p!r} "
                    "was also given; set one of them."
                )
            self.p = implied
        self.p = 1.0 if self.p is None else float(self.p)
        if len(set(self.branches)) != len(self.branches):
            raise RangeError("TangentConfig.branches", self.branches, f"{_BRANCHES_ACCEPTED}, each at most once")
        if self.implementation == "triton" and self.update in NOISE_UPDATES:
            raise ValueError(f"TangentConfig.implementation='triton' with update={self.update!r}: the Triton kernels have "
                             "no noise update; accepted: implementation='fused' or 'reference' for a noise update.")

    # ----------------------------------------------------------------- read-only copies
    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen", False):
            raise dataclasses.FrozenInstanceError(
                f"cannot set TangentConfig.{name}: this config belongs to a patched model and is read-only. "
                "Change the patch with hf_tangent.update_config(model, " + name + "=...) (validated, the saved "
                "record follows), or build a new config with dataclasses.replace(config, ...)."
            )
        super().__setattr__(name, value)

    def frozen_copy(self) -> TangentConfig:
        """A validated read-only copy: what a patched model keeps, so that later changes to the
        caller's object cannot reach the model."""
        copy = TangentConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        object.__setattr__(copy, "_frozen", True)
        return copy

    @property
    def is_frozen(self) -> bool:
        return self.__dict__.get("_frozen", False)

    # ----------------------------------------------------------------- model-dependent checks
    def resolve_layers(self, num_layers: int) -> tuple[int, ...]:
        """The patched layer indices, non-negative and sorted, for a model of `num_layers` layers."""
        if self.layers is None:
            return tuple(range(num_layers))
        return _normalize("layers", self.layers, num_layers)

    def resolve_parallel_layers(self, num_layers: int) -> tuple[int, ...]:
        return _normalize("parallel_layers", self.parallel_layers, num_layers)

    @property
    def is_identity(self) -> bool:
        """True when the patch cannot change any output (the unmodified residual add)."""
        return self.update == "add" and self.alpha == 1.0 and not self.gates and not self.parallel_layers

    # ----------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["layers"] = None if self.layers is None else list(self.layers)
        out["parallel_layers"] = list(self.parallel_layers)
        out["branches"] = list(self.branches)
        out["p"] = "inf" if math.isinf(self.p) else self.p  # JSON has no Infinity
        out["hf_tangent_version"] = __version__
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, strict: bool = False) -> TangentConfig:
        """Build from a dict written by `to_dict`; keys from newer versions are dropped with a warning,
        or refused with `strict=True` (what every loader of a saved patch uses: a misspelled key
        must not load the default silently)."""
        if not isinstance(data, dict):
            raise ValueError(f"TangentConfig.from_dict expects a mapping of field: value, got {type(data).__name__}.")
        data = dict(data)
        data.pop("hf_tangent_version", None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown and strict:
            raise ValueError(f"TangentConfig: unknown keys {unknown}; accepted: {', '.join(sorted(known))}.")
        if unknown:
            warnings.warn(
                f"TangentConfig: ignoring unknown keys {unknown} (written by a newer hf_tangent?).",
                stacklevel=2,
            )
        kwargs = {k: v for k, v in data.items() if k in known}
        if kwargs.get("p") == "inf":  # JSON has no Infinity: to_dict writes it as "inf"; any other string is refused
            kwargs["p"] = math.inf
        return cls(**kwargs)

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json_string(cls, text: str) -> TangentConfig:
        return cls.from_dict(json.loads(text))


_BRANCHES_ACCEPTED = "a non-empty list of values among " + ", ".join(map(repr, BRANCHES))


def check_fields(config, prefix: str) -> None:
    """Every field of `config` (a TangentConfig, or the PEFT config that holds its fields) checked in field
    order and kept as what it means: numbers as int / float, lists as tuples, text as plain str."""
    def keep(name, check, *args, **kwargs):
        object.__setattr__(config, name, check(prefix + name, getattr(config, name), *args, **kwargs))

    ranges = TangentConfig.RANGES
    keep("update", choice, UPDATES)
    keep("beta", number, ranges["beta"])
    keep("p", number, ranges["p"], none=True)
    keep("retraction", choice, RETRACTION_NAMES, none=True)
    for name in ("alpha", "eps"):
        keep(name, number, ranges[name])
    keep("eps_mode", choice, EPS_MODES)
    for name in ("gamma", "noise_h", "noise_rank"):
        keep(name, number, ranges[name])
    keep("branches", listed, _BRANCHES_ACCEPTED, lambda v: str.__str__(v) if isinstance(v, str) and str.__str__(v)
         in BRANCHES else None, empty=False)
    if config.layers is not None:
        keep("layers", listed, "a list of integers, or None", index, number=True)
    keep("gates", flag)
    keep("parallel_layers", listed, "a list of integers", index, number=True)
    keep("parallel_execution", choice, PARALLEL_EXECUTIONS)
    keep("implementation", choice, IMPLEMENTATIONS)


def _normalize(name: str, indices: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    out = []
    for i in indices:
        if not -num_layers <= i < num_layers:
            raise ValueError(
                f"TangentConfig.{name}: layer index {i} is out of range for a model with {num_layers} "
                f"layers; accepted: {-num_layers}..{num_layers - 1}."
            )
        out.append(i % num_layers)
    if len(set(out)) != len(out):
        raise ValueError(f"TangentConfig.{name}={list(indices)} names a layer twice (after resolving negatives).")
    return tuple(sorted(out))
