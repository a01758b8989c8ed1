"""`hf-tangent diagnose`: per-layer radial fraction, norms, angles, diversity, deficit (math.md section 4)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..analysis.evaluation import update_variants
from ..ranges import LAYER_INDICES, Range
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
class DiagnoseArguments(Checked):
    RANGES: ClassVar[dict[str, Range]] = {"layers": LAYER_INDICES}

    layers: list[int] | None = field(default=None, metadata={"help": "layers to observe (default all)"})
    update: str | None = field(default=None, metadata={
        "help": "diagnose the model patched with this variant (default: unpatched): " + "; ".join(update_variants()),
        "choices": list(update_variants()), "metavar": "NAME"})


def diagnose_command_parser(subparsers):
    return add_command(subparsers, "diagnose", (ModelArguments, EvalTextArguments, RunArguments, DiagnoseArguments),
                       "per-layer radial fraction, norms, angles, diversity, deficit",
                       diagnose_command, docs="diagnostics.md")


def diagnose_command(args) -> int:
    from ..experiments.analysis import diagnose_layers

    model, text, run, options = dataclasses_of(args.parser, args)
    preflight(text, run, output_dir=run.output_dir, device=run.device)
    report = diagnose_layers(model.model, text=text_source(text), update=options.update, layers=options.layers,
                             seq_len=text.seq_len, max_windows=text.max_windows, batch_size=run.batch_size,
                             dtype=model.dtype, device=run.device, seed=run.seed)
    report.save(run.output_dir, echo=True)
    return 0
