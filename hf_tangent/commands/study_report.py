"""`hf-tangent study-report`: docs/studies.md from study report.json files (merged by seed)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .arguments import Checked, CommandError, add_command, dataclasses_of


@dataclass
class StudyReportArguments(Checked):
    output: str = field(default="docs/studies.md", metadata={"help": "the page to write"})


def study_report_command_parser(subparsers):
    sub = add_command(subparsers, "study-report", (StudyReportArguments,),
                      "write docs/studies.md from study report.json files", study_report_command, recipe=False)
    sub.add_argument("reports", nargs="+", help="report.json files written by `hf-tangent study`")
    return sub


def study_report_command(args) -> int:
    from ..experiments.studies import write_study_page

    (options,) = dataclasses_of(args.parser, args)
    reports = []
    for path in args.reports:
        try:
            reports.append((path, json.loads(Path(path).read_text(encoding="utf-8"))))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CommandError(f"{path}: not a readable report.json ({err}).") from None
    print(f"wrote {write_study_page(reports, Path(options.output))}")
    return 0
