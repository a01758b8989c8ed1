"""`hf-tangent parallel-sweep`: held-out loss against the number of parallel-converted layers."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from ..experiments.analysis import PARALLEL_SWEEP_RANGES, parallel_sweep
from ..ranges import Range
from .arguments import CalibrationTextArguments as _Calibration
from .arguments import Checked, experiment_command, text_source


@dataclass
class SweepArguments(Checked):
    RANGES: ClassVar[dict[str, Range]] = PARALLEL_SWEEP_RANGES

    calibration_files: list[str] | None = field(default=None, metadata={
        "help": "calibration text for C_l and the greedy selection (default: the Austen calibration novels)"})
    calibration_windows: int = field(default=4, metadata={"help": "calibration windows (C_l, greedy, budget)"})
    ks: list[int] | None = field(default=None, metadata={"help": "numbers of converted layers to evaluate (default 0..L)"})
    random_seeds: list[int] = field(default_factory=lambda: [0, 1, 2], metadata={"help": "seeds of the random order"})
    greedy: bool = field(default=True, metadata={"help": "also the loss-aware greedy selection (O(L^2) evaluations)"})
    greedy_max_k: int | None = field(default=None, metadata={"help": "stop the greedy selection after this many layers"})
    budget: float = field(default=0.02, metadata={"help": "loss budget (nats/token) for the recommendation"})
    speed: bool = field(default=True, metadata={
        "help": "measure T_A, T_Phi and the end-to-end latency of the recommended conversion"})


def parallel_sweep_command_parser(subparsers):
    return experiment_command(subparsers, "parallel-sweep", SweepArguments,
                              "held-out loss vs number of parallel-converted layers: low-C_l, high-C_l, random, greedy",
                              parallel_sweep, options=_options,
                              text=lambda text, own: text_source(text, _Calibration(calibration_files=own.calibration_files)))


def _options(own) -> dict:
    return {k: v for k, v in dataclasses.asdict(own).items() if k != "calibration_files"}
