"""`hf-tangent ablate`: loss increase of zero-FFN, radial-only, tangential-only, attention-zero."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..analysis.ablation import VARIANTS
from ..experiments.analysis import ABLATE_RANGES
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
class AblateArguments(Checked):
    RANGES: ClassVar[dict[str, Range]] = ABLATE_RANGES

    variants: list[str] = field(default_factory=lambda: list(VARIANTS), metadata={
        "help": "ablations to run", "choices": list(VARIANTS)})
    layerwise: bool = field(default=False, metadata={
        "help": "also ablate one layer at a time (layers x variants forward passes)"})
    bootstrap: int = field(default=2000, metadata={"help": "bootstrap resamples for the 95% intervals (>= 1)"})


def ablate_command_parser(subparsers):
    return add_command(subparsers, "ablate", (ModelArguments, EvalTextArguments, RunArguments, AblateArguments),
                       "loss increase of zero-FFN, radial-only, tangential-only, attention-zero (paired bootstrap CI)",
                       ablate_command)


def ablate_command(args) -> int:
    from ..experiments.analysis import ablate

    model, text, run, options = dataclasses_of(args.parser, args)
    preflight(text, run, options, output_dir=run.output_dir, device=run.device)
    report = ablate(model.model, text=text_source(text), variants=options.variants, layerwise=options.layerwise,
                    bootstrap=options.bootstrap, seq_len=text.seq_len, max_windows=text.max_windows,
                    batch_size=run.batch_size, dtype=model.dtype, device=run.device, seed=run.seed)
    report.save(run.output_dir, echo=True)
    return 0
