"""`hf-tangent critical`: critical directions of each layer's reduced fields on the sphere and the
types of their tangent Jacobians (docs/geometry.md; the paper's Table 2)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..experiments.geometry import CRITICAL_RANGES
from ..geometry import FIELDS
from ..ranges import Range
from .arguments import (
    Checked,
    EvalTextArguments,
    ModelArguments,
    RunArguments,
    add_command,
    dataclasses_of,
    preflight,
    text_source,
)


@dataclass
class CriticalArguments(Checked):
    RANGES: ClassVar[dict[str, Range]] = CRITICAL_RANGES

    layers: list[int] | None = field(default=None, metadata={"help": "layers to analyse (default all)"})
    fields: list[str] = field(default_factory=lambda: list(FIELDS), metadata={
        "help": "reduced fields: attention (OV-only), ffn (FFN-only), full (their sum)"})
    random_starts: int = field(default=32, metadata={"help": "random Gaussian starts per layer and field"})
    token_starts: int = field(default=32, metadata={"help": "real token directions (block inputs) as starts"})
    steps: int = field(default=300, metadata={"help": "Adam steps per start before the refinement"})
    threshold: float = field(default=0.05, metadata={"help": "zero score ||P_u F|| / ||F|| accepted as critical"})
    rel_tol: float = field(default=0.01, metadata={"help": "|Re lambda| below rel_tol x spectral radius counts as zero"})


def critical_command_parser(subparsers):
    return add_command(subparsers, "critical", (ModelArguments, EvalTextArguments, RunArguments, CriticalArguments),
                       "critical directions of the reduced fields and their tangent-Jacobian types (docs/geometry.md)",
                       critical_command)


def critical_command(args) -> int:
    from ..experiments.geometry import critical

    model, text, run, options = dataclasses_of(args.parser, args)
    preflight(text, run, output_dir=run.output_dir, device=run.device)
    report = critical(model.model, text=text_source(text), layers=options.layers, fields=options.fields,
                      random_starts=options.random_starts, token_starts=options.token_starts, steps=options.steps,
                      threshold=options.threshold, rel_tol=options.rel_tol, seq_len=text.seq_len,
                      max_windows=text.max_windows, dtype=model.dtype, device=run.device, seed=run.seed)
    report.save(run.output_dir, echo=True)
    return 0
