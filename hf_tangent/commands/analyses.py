"""The analysis commands: each one's own options are the keyword parameters of the recipe function it runs
(arguments.options_dataclass: the annotation, the default, the docstring's help, the function's checks)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..experiments.analysis import ablate, diagnose_layers, parallel_sweep
from ..experiments.geometry import critical, ffn_jacobian, pressure
from .arguments import Checked, experiment_command, options_dataclass

AblateArguments = options_dataclass(ablate, __name__)
DiagnoseLayersArguments = options_dataclass(diagnose_layers, __name__)
ParallelSweepArguments = options_dataclass(parallel_sweep, __name__)
CriticalArguments = options_dataclass(critical, __name__)
PressureArguments = options_dataclass(pressure, __name__)
FfnJacobianArguments = options_dataclass(ffn_jacobian, __name__)


@dataclass
class CalibrationFilesArguments(Checked):
    """parallel-sweep's calibration text (its function takes it inside `text`)."""

    calibration_files: list[str] | None = field(default=None, metadata={
        "help": "calibration text for C_l and the greedy selection (default: the Austen calibration novels)"})


def ablate_command_parser(subparsers):
    return experiment_command(subparsers, "ablate", "loss increase of zero-FFN, radial-only, tangential-only, "
                              "attention-zero (paired bootstrap CI)", ablate, AblateArguments)


def diagnose_command_parser(subparsers):
    return experiment_command(subparsers, "diagnose", "per-layer radial fraction, norms, angles, diversity, deficit",
                              diagnose_layers, DiagnoseLayersArguments, docs="diagnostics.md")


def parallel_sweep_command_parser(subparsers):
    return experiment_command(subparsers, "parallel-sweep", "held-out loss vs number of parallel-converted layers: "
                              "low-C_l, high-C_l, random, greedy", parallel_sweep, ParallelSweepArguments,
                              extra=(CalibrationFilesArguments,))


def critical_command_parser(subparsers):
    return experiment_command(subparsers, "critical", "critical directions of the reduced fields and their "
                              "tangent-Jacobian types", critical, CriticalArguments, docs="geometry.md")


def pressure_command_parser(subparsers):
    return experiment_command(subparsers, "pressure", "spherical diversity under growing attention aggregation, "
                              "per FFN variant", pressure, PressureArguments, docs="geometry.md")


def ffn_jacobian_command_parser(subparsers):
    return experiment_command(subparsers, "ffn-jacobian", "FFN Jacobian, activation gain and keys/values view per "
                              "layer", ffn_jacobian, FfnJacobianArguments, docs="geometry.md")
