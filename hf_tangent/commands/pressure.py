"""`hf-tangent pressure`: spherical diversity after attention and after the FFN as attention is made
to average more tokens, for the full, tangential-only, radial-only and zero FFN (docs/geometry.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..experiments.geometry import PRESSURE_RANGES, PRESSURE_VARIANTS, pressure
from ..ranges import Range
from .arguments import Checked, experiment_command


@dataclass
class PressureArguments(Checked):
    RANGES: ClassVar[dict[str, Range]] = PRESSURE_RANGES

    factors: list[float] = field(default_factory=lambda: [1.0, 0.5, 0.25, 0.1, 0.0], metadata={
        "help": "attention logit-scale factors (1: the model, 0: uniform averaging = most pressure)"})
    variants: list[str] = field(default_factory=lambda: list(PRESSURE_VARIANTS), metadata={
        "help": "FFN variants in all layers: " + ", ".join(PRESSURE_VARIANTS)})
    layers: list[int] | None = field(default=None, metadata={"help": "layers whose diversity is recorded (default all)"})


def pressure_command_parser(subparsers):
    return experiment_command(subparsers, "pressure", PressureArguments,
                              "spherical diversity under growing attention aggregation, per FFN variant",
                              pressure, docs="geometry.md")
