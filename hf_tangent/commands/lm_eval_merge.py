"""`hf-tangent lm-eval-merge`: one lm-eval report from parts of one measurement run separately."""

from __future__ import annotations

from dataclasses import dataclass, field

from .arguments import Checked, add_command, dataclasses_of


@dataclass
class LmEvalMergeArguments(Checked):
    output_dir: str = field(default="runs/latest", metadata={
        "help": "where the merged report.json, report.md and plot go (a new or empty folder, or a run folder)"})


def lm_eval_merge_command_parser(subparsers):
    sub = add_command(subparsers, "lm-eval-merge", (LmEvalMergeArguments,),
                      "merge lm-eval reports that are parts of one measurement (tasks or variants run in separate "
                      "processes): same model and settings, the same numbers wherever two parts scored the same "
                      "variant on the same items", lm_eval_merge_command, recipe=False)
    sub.add_argument("reports", nargs="+", help="report.json files (or their folders) written by `hf-tangent lm-eval`")
    return sub


def lm_eval_merge_command(args) -> int:
    from ..experiments.downstream import merge_lm_eval

    (options,) = dataclasses_of(args.parser, args)  # a report inside --output_dir: refused (runs.in_run_folder)
    merge_lm_eval(list(args.reports)).save(options.output_dir, echo=True)
    return 0
