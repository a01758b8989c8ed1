"""The two commands of `python -m studies`: `study` (from-scratch training studies: tangential, retraction, noise;
docs/studies-guide.md) and `study-report` (docs/studies.md from their report.json files, merged by seed).

Models are built from scratch and seeded by --seeds, so a study has no --model, --dtype or --seed. The options,
recipes (--recipe FILE.yaml), HF_TANGENT_SMOKE=1 and the one-line errors are hf-tangent's (hf_tangent/cli.py)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from hf_tangent import cli
from hf_tangent.commands.arguments import (
    SMOKE,
    Checked,
    CommandError,
    add_command,
    dataclasses_of,
    is_file,
    preflight,
)
from hf_tangent.experiments.common import progress_bar
from hf_tangent.ranges import Range
from hf_tangent.training.data import TextSource

from .study import ARCHS, BUDGET_RANGES, SCALES, STUDIES, check_request, run_study, write_study_page


@dataclass
class StudyArguments(Checked):
    scale: str = field(default="smoke", metadata={"help": f"one of: {', '.join(SCALES)}"})
    arch: str = field(default="gpt2", metadata={"help": f"one of: {', '.join(ARCHS)}"})
    variants: list[str] | None = field(default=None, metadata={"help": "subset of the study's variants (the baseline always runs)"})
    seeds: list[int] | None = field(default=None, metadata={"help": "default: the scale's seeds"})
    branches: list[str] = field(default_factory=lambda: ["ffn"], metadata={"help": "ffn, or ffn attention (rule on both)"})
    output_dir: str = field(default="runs/study", metadata={"help": "where report.json, report.md and plots go"})
    device: str = field(default="cpu", metadata={"help": "cpu, cuda, ..."})
    text_files: list[str] | None = field(default=None, metadata={
        "help": "validation text files (with --calibration-files as training text, or split by document)"})
    dataset: str | None = field(default=None, metadata={"help": "hub dataset (train split / --dataset-split)"})
    dataset_split: str = field(default="test", metadata={"help": "validation split of --dataset"})
    calibration_files: list[str] | None = field(default=None, metadata={"help": "training text files (needs --text-files)"})


@dataclass
class StudyBudget(Checked):
    RANGES: ClassVar[dict[str, Range]] = {k: v for k, v in BUDGET_RANGES.items() if k != "val_windows"} | {
        "max_windows": BUDGET_RANGES["val_windows"]}  # the same ranges as run_study(overrides=...)

    """Overrides of the scale's budget (default: the scale's)."""

    max_steps: int | None = field(default=None, metadata={"help": "optimizer steps per run"})
    eval_every: int | None = field(default=None, metadata={"help": "steps between validation / diagnostics logs"})
    learning_rate: float | None = field(default=None, metadata={"help": "peak AdamW learning rate (cosine schedule)"})
    train_windows: int | None = field(default=None, metadata={"help": "training windows of --seq-len tokens"})
    seq_len: int | None = field(default=None, metadata={"help": "tokens per window"})
    batch_size: int | None = field(default=None, metadata={"help": "training batch size"})
    max_windows: int | None = field(default=None, metadata={"help": "validation windows"})


def study_command_parser(subparsers):
    sub = add_command(subparsers, "study", (StudyArguments, StudyBudget),
                      "from-scratch training studies: tangential, retraction, noise", study_command,
                      docs="studies-guide.md")
    sub.add_argument("study", nargs="?", help=f"one of: {', '.join(STUDIES)} (or `study:` in a --recipe)")
    return sub


def _documents(options):
    """(train documents, validation documents, their description) or Nones for the scale's text."""
    if not (options.text_files or options.dataset or options.calibration_files):
        return None, None, None
    text = TextSource(text_files=tuple(options.text_files or ()) or None, dataset=options.dataset,
                      dataset_split=options.dataset_split, calibration_files=tuple(options.calibration_files or ()) or None)
    described = text.describe(training=True)
    return text.training_documents(), text.evaluation_documents(training=True), \
        f"{described['calibration']} / {described['evaluation']}"


def study_command(args) -> int:
    options, budget = dataclasses_of(args.parser, args)
    if args.study is None:
        raise CommandError(f"name a study: one of {', '.join(STUDIES)} (or `study:` in a --recipe).")
    if options.calibration_files and not options.text_files:
        raise CommandError("--calibration-files needs --text-files as the validation text.")
    preflight(options, output_dir=options.output_dir, device=options.device)
    names = check_request(args.study, options.scale, options.variants, options.arch)  # errors before any work
    overrides = {"max_steps": budget.max_steps, "eval_every": budget.eval_every, "learning_rate": budget.learning_rate,
                 "train_windows": budget.train_windows, "seq_len": budget.seq_len, "batch_size": budget.batch_size,
                 "val_windows": budget.max_windows}
    train_docs, val_docs, data = _documents(options)
    seeds = list(options.seeds or SCALES[options.scale]["seeds"])
    if os.environ.get("HF_TANGENT_SMOKE") == "1" and len(seeds) > SMOKE["seeds"]:  # --seeds: capped by cli.py
        print(f"HF_TANGENT_SMOKE=1: the {options.scale} scale's seeds {seeds} -> {seeds[:SMOKE['seeds']]}",
              file=sys.stderr)
        seeds = seeds[:SMOKE["seeds"]]
    with progress_bar(True, len(names) * len(seeds), f"study {args.study} ({options.scale})", "run") as bar:
        report = run_study(args.study, options.scale, arch=options.arch, variants=options.variants, seeds=seeds,
                           branches=tuple(options.branches), output_dir=options.output_dir, device=options.device,
                           progress=bar, overrides=overrides, train_docs=train_docs, val_docs=val_docs, data=data)
    report.data |= {"hf_tangent_version": __import__("hf_tangent").__version__, "device": options.device}
    report.data["plots"] = {"validation loss": f"{args.study}_val_loss.png", "diagnostics": f"{args.study}_diagnostics.png"}
    report.save(options.output_dir, echo=True)
    return 0


@dataclass
class StudyReportArguments(Checked):
    output: str = field(default="docs/studies.md", metadata={"help": "the page to write"})


def study_report_command_parser(subparsers):
    sub = add_command(subparsers, "study-report", (StudyReportArguments,),
                      "write docs/studies.md from study report.json files", study_report_command, recipe=False)
    sub.add_argument("reports", nargs="+", help="report.json files written by `python -m studies study`")
    return sub


def study_report_command(args) -> int:
    (options,) = dataclasses_of(args.parser, args)
    reports = []
    for path in args.reports:
        try:
            reports.append((path, json.loads(Path(path).read_text(encoding="utf-8"))))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CommandError(f"{path}: not a readable report.json ({err}).") from None
    page = Path(options.output)
    try:  # (OSError: a name too long, a folder that cannot be read)
        if page.is_dir() or not next(p for p in page.absolute().parents if p.exists()).is_dir():
            raise CommandError(f"--output {page} is a folder or lies under a file; accepted: the path of the page to "
                               "write (the reports and plots it shows go to results/studies/ beside it).")
        print(f"wrote {write_study_page(reports, page)}")
    except OSError as err:  # a folder that does not allow writing, a full disk: one line, as every error of the command
        raise CommandError(f"--output {page}: {err}") from None
    return 0


COMMANDS = (study_command_parser, study_report_command_parser)
DESCRIPTION = """\
From-scratch training studies of the update rules (docs/studies-guide.md), and the results page they render.

  python -m studies study tangential --scale cpu            one study (tangential, retraction or noise)
  python -m studies study --recipe studies/recipes/study_tangential.yaml
  python -m studies study-report runs/study-*/report.json   docs/studies.md from the runs' reports"""


RECIPES = Path(__file__).resolve().parent / "recipes"


def _recipe(name: str) -> str:
    """A --recipe that is no file but the name of one of studies/recipes/ (hf-tangent's shipped recipes are for
    its own commands), as that file's path."""
    path = RECIPES / f"{name}.yaml"
    return str(path) if name.replace("_", "").isalnum() and not is_file(Path(name)) and is_file(path) else name


def main(argv=None) -> int:
    """`python -m studies`: hf-tangent's command line (options, recipes, HF_TANGENT_SMOKE, errors) with these two."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((i for i, token in enumerate(argv) if not token.startswith("-")), len(argv))
    for i, token in enumerate(argv[command:], start=command):  # a command's --recipe (before it: argparse's error)
        if token == "--recipe" and i + 1 < len(argv):
            argv[i + 1] = _recipe(argv[i + 1])
        elif token.startswith("--recipe="):
            argv[i] = "--recipe=" + _recipe(token[len("--recipe="):])
    return cli.main(argv, commands=COMMANDS, prog="python -m studies", description=DESCRIPTION)
