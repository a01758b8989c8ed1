"""`hf-tangent sensitivity`: the FFN input-sensitivity C_l of every layer, on calibration text."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..experiments.analysis import layer_sensitivity
from ..ranges import TEXT_RANGES, Range
from .arguments import CalibrationTextArguments as _Calibration
from .arguments import Checked, ModelArguments, RunArguments, add_command, dataclasses_of, preflight, text_source


@dataclass
class SensitivityArguments(Checked):
    RANGES: ClassVar[dict[str, Range]] = {k: TEXT_RANGES[k] for k in ("seq_len", "max_windows")}

    calibration_files: list[str] | None = field(default=None, metadata={
        "help": "calibration text files (default: the Austen calibration novels)"})
    seq_len: int = field(default=512, metadata={"help": "tokens per window"})
    max_windows: int = field(default=8, metadata={"help": "calibration windows"})


def sensitivity_command_parser(subparsers):
    return add_command(subparsers, "sensitivity", (ModelArguments, SensitivityArguments, RunArguments),
                       "FFN input-sensitivity C_l of every layer on calibration text",
                       sensitivity_command, docs="parallel.md", recipe_function=layer_sensitivity)


def sensitivity_command(args) -> int:
    model, options, run = dataclasses_of(args.parser, args)
    preflight(options, run, output_dir=run.output_dir, device=run.device)
    text = text_source(None, _Calibration(calibration_files=options.calibration_files))
    report = layer_sensitivity(model.model, text=text, seq_len=options.seq_len, max_windows=options.max_windows,
                               batch_size=run.batch_size, dtype=model.dtype, device=run.device, seed=run.seed)
    report.save(run.output_dir, echo=True)
    return 0
