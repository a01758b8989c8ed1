"""`hf-tangent critical`: critical directions of each layer's reduced fields on the sphere and the
types of their tangent Jacobians (docs/geometry.md; the paper's Table 2)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from ..analysis.geometry import FIELDS
from ..experiments.geometry import CRITICAL_RANGES, critical
from ..ranges import Range
from .arguments import Checked, experiment_command


@dataclass
class CriticalArguments(Checked):
    RANGES: ClassVar[dict[str, Range]] = CRITICAL_RANGES

    layers: list[int] | None = field(default=None, metadata={"help": "layers to analyse (default all)"})
    fields: list[str] = field(default_factory=lambda: list(FIELDS), metadata={
        "help": "reduced fields: attention (OV-only), ffn (FFN-only), full (their sum)"})
    random_starts: int = field(default=32, metadata={"help": "random Gaussian starts per layer and field"})
    token_starts: int = field(default=32, metadata={"help": "real token directions (block inputs) as starts"})
    protocol: Literal["refined", "paper"] = field(default="refined", metadata={
        "help": "refined: roots of P_u F refined in float64 to a zero score < --tol (critical directions); paper: the "
                "paper's thresholded near-invariant directions (score < --threshold), for a like-for-like Table 2"})
    steps: int = field(default=300, metadata={"help": "Adam steps per start before the refinement"})
    threshold: float = field(default=0.05, metadata={
        "help": "search threshold: starts whose zero score ||P_u F|| / ||F|| ends below it are refined (refined) or "
                "counted as candidates (paper)"})
    tol: float = field(default=1e-8, metadata={"help": "refined: a root's zero score must fall below this (float64)"})
    max_iter: int = field(default=20, metadata={"help": "refined: Newton / Levenberg-Marquardt steps per start"})
    rel_tol: float = field(default=0.01, metadata={
        "help": "paper: |Re lambda| below rel_tol x spectral radius counts as zero (refined types by sign)"})


def critical_command_parser(subparsers):
    return experiment_command(subparsers, "critical", CriticalArguments,
                              "critical directions of the reduced fields and their tangent-Jacobian types",
                              critical, docs="geometry.md")
