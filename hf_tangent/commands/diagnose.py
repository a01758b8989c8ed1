"""`hf-tangent diagnose`: per-layer radial fraction, norms, angles, diversity, deficit (math.md section 4)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..analysis.evaluation import update_variants
from ..experiments.analysis import diagnose_layers
from ..ranges import LAYER_INDICES, Range
from .arguments import Checked, experiment_command


@dataclass
class DiagnoseArguments(Checked):
    RANGES: ClassVar[dict[str, Range]] = {"layers": LAYER_INDICES}

    layers: list[int] | None = field(default=None, metadata={"help": "layers to observe (default all)"})
    update: str | None = field(default=None, metadata={
        "help": "diagnose the model patched with this variant (default: unpatched): " + "; ".join(update_variants()),
        "choices": list(update_variants()), "metavar": "NAME"})


def diagnose_command_parser(subparsers):
    return experiment_command(subparsers, "diagnose", DiagnoseArguments,
                              "per-layer radial fraction, norms, angles, diversity, deficit", diagnose_layers,
                              docs="diagnostics.md")
