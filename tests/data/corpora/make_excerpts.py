"""Writes tests/data/corpora/root/: small excerpts of the Debian package files the mixed-domain corpus
(hf_tangent.training.corpora) reads, in their original formats and at their installed paths, for
tests that run without apt.

    mkdir x && for p in python3.11-doc gnu-standards debian-handbook dict-gcide jargon-text; do
        apt-get download $p && dpkg-deb -x ${p}_*.deb x; done
    python tests/data/corpora/make_excerpts.py x

Made from Debian 12 (bookworm): python3.11-doc 3.11.2-6+deb12u8, gnu-standards 2022.03.23-0.1,
debian-handbook 11.20220922, dict-gcide 0.48.5+nmu2, jargon-text 4.4.7-4.1. HTML and text files are
kept as line ranges of the originals (1-based, inclusive; the rest of a page is left out, so some of
its elements stay unclosed, as HTML parsers allow); the dictionary keeps a few whole entries, with an
index whose offsets point at them. Licences: README.md here.
"""

import gzip
import sys
from pathlib import Path

from hf_tangent.training.corpora.clean import dictd_number

TARGET = Path(__file__).resolve().parent / "root"
PYTHON = "usr/share/doc/python3.11/html"
HANDBOOK = "usr/share/doc/debian-handbook/html/en-US"
GNU = "usr/share/doc/gnu-standards"
# path -> line ranges kept (None: the whole file)
LINES = {
    # the head, the navigation, the body up to the end of section 2.1, then the sidebar and footer
    f"{PYTHON}/tutorial/interpreter.html": [(1, 4), (49, 256), (296, 423)],
    f"{PYTHON}/faq/installed.html": None,
    f"{HANDBOOK}/sect.apt-file.html": None,
    f"{HANDBOOK}/sect.asynchronous-task-scheduling-anacron.html": None,
    # the title page and the start of the table of contents; chapter 1; chapter 2's introduction and
    # its first section; chapter 3's introduction and section 3.4 (code examples); the start of the
    # GFDL and of the index; the end of the page
    f"{GNU}/standards.html": [(1, 100), (176, 312), (401, 423), (546, 628), (684, 684), (6627, 6650),
                              (7105, 7125), (7445, 7454)],
    # the title page; the chapters "Clean-Ups" and "Platforms"; the end of the page
    f"{GNU}/maintain.html": [(1, 70), (1338, 1436), (4355, 4362)],
}
JARGON = "usr/share/doc/jargon-text/jargon.txt.gz"
# the title and table of contents; chapter 6 (quoted-mail examples, indented deeper); the lexicon's
# heading and table of contents; its first entries; the entries baroque to baz; the start of
# appendix A; the start of the Story of Mel
JARGON_LINES = [(1, 12), (1494, 1583), (2115, 2140), (6805, 6856), (9000, 9104), (40101, 40140), (40642, 40684)]
GCIDE = "usr/share/dictd"
GCIDE_HEADWORDS = ("00-database-short", "Abandon", "Bell", "Cockle", "Computer", "Hagiology", "Happy", "Mesprise",
                   "Necrotomy", "Subscriptive", "Truth")


def keep_lines(text: str, ranges) -> str:
    lines = text.splitlines(keepends=True)
    return "".join(line for first, last in ranges for line in lines[first - 1:last])


def main(source: Path) -> None:
    for path, ranges in LINES.items():
        text = (source / path).read_text(encoding="utf-8")
        (TARGET / path).parent.mkdir(parents=True, exist_ok=True)
        (TARGET / path).write_text(text if ranges is None else keep_lines(text, ranges), encoding="utf-8")
    jargon = gzip.decompress((source / JARGON).read_bytes()).decode("utf-8")
    (TARGET / JARGON).parent.mkdir(parents=True, exist_ok=True)
    (TARGET / JARGON).write_bytes(gzip.compress(keep_lines(jargon, JARGON_LINES).encode("utf-8"), mtime=0))
    # Every index line of the chosen headwords, their entries copied into a new data file.
    data = gzip.decompress((source / GCIDE / "gcide.dict.dz").read_bytes())
    index_lines = (source / GCIDE / "gcide.index").read_text(encoding="utf-8").splitlines()
    chosen = [line.split("\t") for line in index_lines if line.split("\t")[0] in GCIDE_HEADWORDS]
    entries: dict[tuple[int, int], int] = {}  # (offset, length) in the original -> offset in the excerpt
    out = bytearray()
    for _, offset, length in chosen:
        key = (dictd_number(offset), dictd_number(length))
        if key not in entries:
            entries[key] = len(out)
            out += data[key[0]:key[0] + key[1]]
    index = [f"{word}\t{encode(entries[(dictd_number(o), dictd_number(n))])}\t{n}\n" for word, o, n in chosen]
    (TARGET / GCIDE).mkdir(parents=True, exist_ok=True)
    (TARGET / GCIDE / "gcide.index").write_text("".join(index), encoding="utf-8")
    (TARGET / GCIDE / "gcide.dict.dz").write_bytes(gzip.compress(bytes(out), mtime=0))


def encode(number: int) -> str:
    """The inverse of dictd_number."""
    digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    out = ""
    while True:
        number, digit = divmod(number, 64)
        out = digits[digit] + out
        if number == 0:
            return out


if __name__ == "__main__":
    main(Path(sys.argv[1]))
