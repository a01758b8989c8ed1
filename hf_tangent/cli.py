"""`hf-tangent`: the command line. One module per command in hf_tangent/commands/; this file only
builds the parser, applies a --recipe, and dispatches. User errors end in one
`hf-tangent <command>: error: ...` line and exit code 2."""

from __future__ import annotations

import argparse
import sys

from transformers import HfArgumentParser

from .commands import analyses, calibrate, export, finetune, heal, lm_eval, lm_eval_merge, sensitivity
from .commands import eval as eval_
from .commands.arguments import CommandError, apply_recipe, smoke_sizes
from .core._version import __version__

DESCRIPTION = """\
Tangential and retraction FFN updates for Hugging Face causal language models: evaluate the update
rules against the unpatched model, calibrate gates, fine-tune, heal, diagnose, and export patched
models.

  hf-tangent calibrate --recipe offline_default     the main job (real SmolLM2-135M, offline)
  hf-tangent <command> --help                        a command's options and their defaults
  hf-tangent calibrate --help-all                    and every Trainer option (calibrate, finetune, heal)

The commands that run an experiment take --recipe FILE.yaml (or a shipped recipe's name; options
given on the command line win) and write report.json and report.md to their output folder. Errors
end in one `hf-tangent <command>: error: ...` line and exit code 2."""

COMMANDS = (eval_.eval_command_parser, calibrate.calibrate_command_parser, finetune.finetune_command_parser,
            analyses.diagnose_command_parser, analyses.ablate_command_parser, sensitivity.sensitivity_command_parser,
            analyses.parallel_sweep_command_parser, heal.heal_command_parser, analyses.critical_command_parser,
            analyses.pressure_command_parser, analyses.ffn_jacobian_command_parser,
            export.export_command_parser, lm_eval.lm_eval_command_parser,
            lm_eval_merge.lm_eval_merge_command_parser)


def build_parser(commands=COMMANDS, prog: str = "hf-tangent", description: str = DESCRIPTION
                 ) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser of `commands` (this one's, or the checkout's studies/: `python -m studies`)."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"hf_tangent {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=HfArgumentParser)
    return parser, {command.__name__.removesuffix("_command_parser").replace("_", "-"): command(subparsers)
                    for command in commands}


def one_line(err: Exception) -> str:
    return " ".join(line.strip() for line in str(err).splitlines() if line.strip())


def _recipe_of(argv: list[str]) -> str | None:
    for i, token in enumerate(argv):
        if token == "--recipe" and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith("--recipe="):
            return token.split("=", 1)[1]
    return None


def parse_args(argv=None, **build) -> argparse.Namespace:
    """The parsed command line, the recipe's values (if any) under the options given (`build`: build_parser's)."""
    parser, subparsers = build_parser(**build)
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((token for token in argv if not token.startswith("-")), None)
    recipe = _recipe_of(argv)
    if recipe is not None and command in subparsers:
        try:
            apply_recipe(subparsers[command], recipe, command)
        except CommandError as err:
            subparsers[command].error(one_line(err))  # exits 2 with `hf-tangent <command>: error: ...`
    args, extras = parser.parse_known_args(argv)
    if extras:  # reported by the command's own parser: `hf-tangent <command>: error: ...`
        subparsers[args.command].error(f"unrecognized arguments: {' '.join(extras)}")
    try:
        capped = smoke_sizes(args)
    except CommandError as err:
        subparsers[args.command].error(one_line(err))
    if capped is not None:  # in the run's log, so that nobody takes a smoke report for a real one
        print(f"HF_TANGENT_SMOKE=1: sizes capped ({', '.join(capped) or 'none above the smoke size'})", file=sys.stderr)
    return args


def main(argv=None, **build) -> int:
    args = parse_args(argv, **build)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"{build.get('prog', 'hf-tangent')} {args.command}: error: {one_line(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
