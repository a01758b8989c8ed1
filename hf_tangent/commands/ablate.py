"""`hf-tangent ablate`: loss increase of zero-FFN, radial-only, tangential-only, attention-zero."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..analysis.ablation import VARIANTS
from ..experiments.analysis import ABLATE_RANGES, ablate
from ..ranges import Range
from .arguments import Checked, experiment_command


@dataclass
class AblateArguments(Checked):
    RANGES: ClassVar[dict[str, Range]] = ABLATE_RANGES

    variants: list[str] = field(default_factory=lambda: list(VARIANTS), metadata={
        "help": "ablations to run", "choices": list(VARIANTS)})
    layerwise: bool = field(default=False, metadata={
        "help": "also ablate one layer at a time (layers x variants forward passes)"})
    bootstrap: int = field(default=2000, metadata={"help": "bootstrap resamples for the 95% intervals (>= 1)"})


def ablate_command_parser(subparsers):
    return experiment_command(subparsers, "ablate", AblateArguments,
                              "loss increase of zero-FFN, radial-only, tangential-only, attention-zero (paired bootstrap CI)",
                              ablate)
