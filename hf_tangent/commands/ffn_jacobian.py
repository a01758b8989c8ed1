"""`hf-tangent ffn-jacobian`: per layer and token, the FFN's Jacobian on the tangent space, the
activation gain and the keys/values view, next to C_l and the ablation costs (docs/geometry.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..experiments.geometry import FFN_JACOBIAN_RANGES, ffn_jacobian
from ..ranges import Range
from .arguments import Checked, experiment_command


@dataclass
class FfnJacobianArguments(Checked):
    RANGES: ClassVar[dict[str, Range]] = FFN_JACOBIAN_RANGES

    layers: list[int] | None = field(default=None, metadata={"help": "layers to analyse (default all)"})
    tokens: int = field(default=16, metadata={"help": "sampled tokens per layer (one d x d Jacobian each)"})
    top_k: int = field(default=8, metadata={"help": "hidden units counted in the keys/values view"})
    ablation_report: str | None = field(default=None, metadata={
        "help": "report.json of `hf-tangent ablate --layerwise`, to set the per-layer ablation costs beside"})


def ffn_jacobian_command_parser(subparsers):
    return experiment_command(subparsers, "ffn-jacobian", FfnJacobianArguments,
                              "FFN Jacobian, activation gain and keys/values view per layer", ffn_jacobian,
                              docs="geometry.md")
