"""Writes tests/data/austen/: the opening of each Austen novel, for test runs without ../shared.

    python tests/data/make_austen_excerpts.py ../shared/data/austen

Each excerpt is the first 40,000 characters of the novel, cut back to the last blank line (a
paragraph end). The novels are public domain (Project Gutenberg transcriptions, as Debian's
r-cran-janeaustenr package ships them); see tests/data/README.md.
"""

import sys
from pathlib import Path

NOVELS = ("emma", "mansfieldpark", "northangerabbey", "prideprejudice", "sensesensibility")
CHARS = 40_000


def main(source: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for name in NOVELS:
        text = (source / f"{name}.txt").read_text(encoding="utf-8")[:CHARS]
        (target / f"{name}.txt").write_text(text[: text.rindex("\n\n")] + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(__file__).resolve().parent / "austen")
