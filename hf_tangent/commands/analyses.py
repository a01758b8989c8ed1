"""The analysis commands: each one's own options are the keyword parameters of the recipe function it runs
(arguments.options_dataclass: the annotation, the default, the docstring's help, the ranges)."""

from __future__ import annotations

from ..experiments.analysis import ablate, diagnose_layers, parallel_sweep
from ..experiments.geometry import critical, ffn_jacobian, pressure
from .arguments import CalibrationFilesArguments, experiment_command


def ablate_command_parser(subparsers):
    return experiment_command(subparsers, "ablate", "loss increase of zero-FFN, radial-only, tangential-only, "
                              "attention-zero (paired bootstrap CI)", ablate)


def diagnose_command_parser(subparsers):
    return experiment_command(subparsers, "diagnose", "per-layer radial fraction, norms, angles, diversity, deficit",
                              diagnose_layers, docs="diagnostics.md")


def parallel_sweep_command_parser(subparsers):
    return experiment_command(subparsers, "parallel-sweep", "held-out loss vs number of parallel-converted layers: "
                              "low-C_l, high-C_l, random, greedy", parallel_sweep, extra=(CalibrationFilesArguments,))


def critical_command_parser(subparsers):
    return experiment_command(subparsers, "critical", "critical directions of the reduced fields and their "
                              "tangent-Jacobian types", critical, docs="geometry.md")


def pressure_command_parser(subparsers):
    return experiment_command(subparsers, "pressure", "spherical diversity under growing attention aggregation, "
                              "per FFN variant", pressure, docs="geometry.md")


def ffn_jacobian_command_parser(subparsers):
    return experiment_command(subparsers, "ffn-jacobian", "FFN Jacobian, activation gain and keys/values view per "
                              "layer", ffn_jacobian, docs="geometry.md")
