"""The mixed-domain corpus: English prose read out of Debian packages, split by document, capped.

Each domain is one Debian package and one reader. A reader takes a folder of extracted package
files (what `dpkg-deb -x` writes: `usr/share/...`) and returns its sections of prose; `build_corpus`
then, per domain:

1. drops every paragraph already seen earlier in the domain (so no paragraph can be both in a
   training and in a held-out document);
2. merges consecutive small sections of one source unit (a chapter, a run of lexicon entries) into
   documents of at least `Sizes.document_words` words, and drops documents under
   `Sizes.min_document_words` (a chapter's title page, a stub);
3. ranks the documents by a hash of "<domain>/<doc id>" (no random state) and takes the first of
   that order as held-out until they reach 20 % of the domain's words (at least 10,000 words, at
   most 45,000, always leaving one document for training);
4. takes the rest, in the same order, for training until 175,000 words, about 1 MB of text: the
   Austen calibration novels are 1.8 MB (317,000 words), so no Debian domain outweighs them, nor does the
   40 MB dictionary outweigh all the rest.

`extract_packages` downloads the packages with `apt-get download` and unpacks them with `dpkg-deb`.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from .clean import (
    HtmlRules,
    Section,
    dictd_entries,
    dictionary_entry,
    html_paragraphs,
    is_prose,
    merge_sections,
    slug,
    text_paragraphs,
)

SPLITS = ("train", "heldout")
CORPUS_ENV = "HF_TANGENT_CORPUS_DIR"


@dataclass(frozen=True)
class Sizes:
    """How documents are formed and split, in words (1 MB of English text is about 175,000 words)."""

    document_words: int = 1000  # small sections of one source unit are merged up to this
    min_document_words: int = 200  # shorter documents are dropped
    heldout_fraction: float = 0.2
    heldout_min_words: int = 10_000
    heldout_max_words: int = 45_000
    train_max_words: int = 175_000  # about 1 MB: the Austen calibration novels are 1.8 MB


@dataclass(frozen=True)
class Domain:
    """One kind of prose: its name, the Debian package it comes from (austen's is read through
    corpora.austen.austen_dir, the others into the corpus folder), the licence of the text as the package's
    copyright file states it, and what the text is."""

    name: str
    package: str | None
    licence: str
    description: str


DOMAINS: dict[str, Domain] = {d.name: d for d in (
    Domain("austen", "r-cran-janeaustenr", "public domain (the novels; the package's R code is MIT)",
           "Jane Austen's novels: early 19th-century fiction (read through hf_tangent.training.corpora.austen)"),
    Domain("python", "python3-doc", "PSF-2.0 (Python Software Foundation License Version 2; code examples also 0BSD)",
           "Python 3 documentation: the tutorial, the HOWTOs and the FAQ (programming tutorial prose)"),
    Domain("gnu", "gnu-standards", "GFDL-1.3+ (no Invariant Sections, no Front-Cover Texts, no Back-Cover Texts)",
           "The GNU Coding Standards and Information for GNU Maintainers (software-engineering policy)"),
    Domain("debian", "debian-handbook", "GPL-2.0+ or CC-BY-SA-3.0",
           "The Debian Administrator's Handbook (a system-administration book)"),
    Domain("dictionary", "dict-gcide", "GPL-2+",
           "GCIDE, the Collaborative International Dictionary of English (Webster's 1913 and WordNet definitions)"),
    Domain("jargon", "jargon-text", "public domain",
           "The Jargon File 4.4.7: the hacker lexicon, its essays on hacker slang and its folklore appendices"),
)}
CORPUS_DOMAINS = tuple(name for name, domain in DOMAINS.items() if name != "austen")


# --- readers: extracted package files -> sections of prose ------------------------------------------

_PYTHON_RULES = HtmlRules(
    root=lambda tag, attrs: attrs.get("role") == "main",
    skip_classes=frozenset({"headerlink", "sphinxsidebar", "related", "footer", "toctree-wrapper", "contents",
                            "field-list", "highlight", "doctest"}))


def read_python(root: Path) -> list[Section]:
    """Python's tutorial, HOWTO and FAQ pages, one section each (no API reference)."""
    folders = sorted(root.glob("usr/share/doc/python3.*/html"))
    if not folders:
        raise FileNotFoundError(f"no usr/share/doc/python3.*/html under {root}")
    sections = []
    for part in ("tutorial", "howto", "faq"):
        for page in sorted((folders[-1] / part).glob("*.html")):
            if page.name != "index.html":
                paragraphs = [text for _, text in html_paragraphs(page.read_text(encoding="utf-8"), _PYTHON_RULES)]
                sections.append(Section(f"{part}-{page.stem}", f"{part}/{page.name}", paragraphs))
    return sections


_HANDBOOK_RULES = HtmlRules(
    skip_classes=frozenset({"docnav", "toc", "table", "informaltable", "titlepage", "legalnotice", "footnotes",
                            "mediaobject", "figure", "index"}),
    skip_ids=frozenset({"banner", "title"}))


def read_debian_handbook(root: Path) -> list[Section]:
    """The English pages of the Debian Administrator's Handbook, one section each."""
    folder = root / "usr/share/doc/debian-handbook/html/en-US"
    pages = [p for p in sorted(folder.glob("*.html")) if p.name != "index.html"]
    if not pages:
        raise FileNotFoundError(f"no pages in {folder}")
    return [Section(page.stem, page.name, [text for _, text in html_paragraphs(page.read_text(encoding="utf-8"),
                                                                                 _HANDBOOK_RULES)])
            for page in pages]


_TEXINFO_SECTION = re.compile(r"^(top|chapter|appendix|unnumbered|(sub)*section|(appendix|unnumbered)(sub)*sec)"
                              r"(-level-extent)?$")


def _texinfo_section(tag: str, attrs: dict[str, str]) -> str | None:
    if tag == "div" and any(_TEXINFO_SECTION.match(c) for c in attrs.get("class", "").split()):
        return attrs.get("id") or "unnamed"
    return None


def _texinfo_name(node_id: str) -> str:
    """A node's id as a file name: texinfo writes "Non-Free" as "Non_002dFree"."""
    return slug(re.sub(r"_([0-9a-f]{4})", lambda m: chr(int(m.group(1), 16)), node_id))


_TEXINFO_RULES = HtmlRules(
    section=_texinfo_section,
    skip_classes=frozenset({"header", "nav-panel", "contents", "Contents_element", "shortcontents", "section-toc",
                            "menu", "example", "display", "lisp", "smallexample", "smalldisplay", "format",
                            "index-cp", "index-fn", "printindex"}),
    skip_ids=frozenset({"GNU-Free-Documentation-License", "Index", "SEC_Contents", "SEC_Overview"}))


def read_gnu_standards(root: Path) -> list[Section]:
    """The GNU Coding Standards and the GNU maintainers' guide (single-page HTML): one section per
    texinfo node, grouped by chapter; the title page (copyright notice), the GFDL and the index are left out."""
    sections = []
    for manual in ("standards", "maintain"):
        page = root / f"usr/share/doc/gnu-standards/{manual}.html"
        if not page.is_file():
            raise FileNotFoundError(f"no {page}")
        current: Section | None = None
        for path, text in html_paragraphs(page.read_text(encoding="utf-8"), _TEXINFO_RULES):
            path = tuple(p for p in path if p != "Top")  # Top: title and copyright, or (texinfo 7) the whole manual
            if not path:
                continue
            doc_id = f"{manual}-{_texinfo_name(path[-1])}"
            if current is None or current.doc_id != doc_id:
                current = Section(doc_id, f"{manual}-{_texinfo_name(path[0])}")
                sections.append(current)
            current.paragraphs.append(text)
    return sections


_HEADWORD = re.compile(r"^   :(.+?):")


def read_jargon(root: Path) -> list[Section]:
    """The Jargon File: its chapters and appendices (a section per heading) and its lexicon entries
    (a section per entry, the headword in front of the entry's first paragraph)."""
    path = root / "usr/share/doc/jargon-text/jargon.txt.gz"
    lines = gzip.decompress(path.read_bytes()).decode("utf-8").splitlines()
    sections: list[Section] = []
    part, name, headword, body = "introduction", "front-matter", None, []

    def close() -> None:
        if part == "lexicon" and headword is None:
            return  # the lexicon's table of contents: headwords only
        paragraphs = [p.replace("{", "").replace("}", "") for p in text_paragraphs(body, indent=3)]  # {see also}
        if headword is not None and paragraphs:
            entry = f"{headword}: {paragraphs[0]}"
            paragraphs = [entry, *paragraphs[1:]] if is_prose(entry) else paragraphs
        sections.append(Section(name, part, paragraphs))

    for line in lines:
        entry = _HEADWORD.match(line) if part == "lexicon" else None
        heading = line[:1].strip() and not ("\u2500" <= line[0] <= "\u257f")  # column 0, not a table rule
        if not (entry or heading):
            body.append(line)
            continue
        close()
        body = []
        if entry:
            name, headword = f"lexicon-{slug(entry.group(1))}", entry.group(1)
            continue
        headword = None
        if line.startswith("Glossary"):
            part = "lexicon"
        elif line.startswith(("Appendix", "Bibliography")):
            part = "appendices"
        name = slug(line.strip())
    close()
    return sections


def _entry_headword(entry: str, fallback: str) -> str:
    """The word an entry starts with ("Far \\Far\\, adv."): an index line may name a phrase in it ("as far as")."""
    head = entry.split("\n", 1)[0].split("\\", 1)[0].strip(" ,")
    return head if 0 < len(head) <= 40 else fallback


def read_gcide(root: Path) -> list[Section]:
    """GCIDE's entries (dictd format), one section each, all in one group: merged in dictionary
    order into documents of consecutive entries. The database's own notices (00-...) are left out."""
    folder = root / "usr/share/dictd"
    index = (folder / "gcide.index").read_text(encoding="utf-8")
    data = gzip.decompress((folder / "gcide.dict.dz").read_bytes())  # dictzip is gzip with random-access extras
    sections = []
    for headword, entry in dictd_entries(index, data):
        if not headword.startswith("00-"):
            text = dictionary_entry(entry)
            if is_prose(text):
                sections.append(Section(slug(_entry_headword(entry, headword)).lower(), "gcide", [text]))
    return sections


READERS: dict[str, Callable[[Path], list[Section]]] = {
    "python": read_python, "gnu": read_gnu_standards, "debian": read_debian_handbook,
    "dictionary": read_gcide, "jargon": read_jargon,
}


# --- documents and the split -------------------------------------------------------------------------


def documents(sections: list[Section], sizes: Sizes = Sizes()) -> list[Section]:
    """Sections deduplicated (a paragraph's later repeats dropped, domain-wide), merged, and filtered."""
    seen: set[str] = set()
    unique = []
    for section in sections:
        paragraphs = [p for p in section.paragraphs if not (p in seen or seen.add(p))]
        unique.append(Section(section.doc_id, section.group, paragraphs))
    docs = [d for d in merge_sections(unique, sizes.document_words) if d.words >= sizes.min_document_words]
    taken: set[str] = set()
    for doc in docs:  # one file per document: a repeated id gets a suffix
        base, n = doc.doc_id, 1
        while doc.doc_id in taken:
            n += 1
            doc.doc_id = f"{base}-{n}"
        taken.add(doc.doc_id)
    return docs


def split_documents(domain: str, docs: list[Section], sizes: Sizes = Sizes()) -> dict[str, list[Section]]:
    """{"train": [...], "heldout": [...]}: by document, in the order of a hash of their ids (module docstring)."""
    if len(docs) < 2:
        raise ValueError(f"domain {domain!r} has {len(docs)} document(s); a split needs at least 2.")
    ranked = sorted(docs, key=lambda d: hashlib.sha256(f"{domain}/{d.doc_id}".encode()).hexdigest())
    total = sum(d.words for d in ranked)
    target = min(max(sizes.heldout_fraction * total, sizes.heldout_min_words), sizes.heldout_max_words)
    heldout, words = [], 0
    while words < target and len(heldout) < len(ranked) - 1:
        heldout.append(ranked[len(heldout)])
        words += heldout[-1].words
    train, words = [], 0
    for doc in ranked[len(heldout):]:
        if words >= sizes.train_max_words:
            break
        train.append(doc)
        words += doc.words
    return {"train": train, "heldout": heldout}


def build_corpus(root: Path, target: Path, versions: dict[str, str] | None = None,
                 sizes: Sizes = Sizes()) -> dict[str, dict[str, list[Section]]]:
    """Reads every corpus domain out of the extracted packages under `root` and writes
    target/<domain>/<split>/<doc id>.txt (paragraphs joined by blank lines) and target/SOURCES.md.
    `versions`: package -> version, for SOURCES.md. Returns domain -> split -> documents."""
    corpus = {name: split_documents(name, documents(READERS[name](root), sizes), sizes) for name in CORPUS_DOMAINS}
    for name, splits in corpus.items():
        for split, docs in splits.items():
            folder = target / name / split
            folder.mkdir(parents=True, exist_ok=True)
            for doc in docs:
                (folder / f"{doc.doc_id}.txt").write_text("\n\n".join(doc.paragraphs) + "\n", encoding="utf-8")
    (target / "SOURCES.md").write_text(sources_markdown(corpus, versions or {}, sizes), encoding="utf-8")
    (target / "sources.json").write_text(json.dumps(sources_record(corpus, versions or {}, sizes), indent=2) + "\n",
                                         encoding="utf-8")
    return corpus


def sources_record(corpus: dict[str, dict[str, list[Section]]], versions: dict[str, str], sizes: Sizes) -> dict:
    """What SOURCES.md says, as data (docs/figures.py renders the corpus table from a kept copy)."""
    return {"sizes": dataclasses.asdict(sizes), "domains": {
        name: {"package": DOMAINS[name].package, "version": versions.get(DOMAINS[name].package),
               "licence": DOMAINS[name].licence, "description": DOMAINS[name].description,
               **{split: {"documents": len(docs), "words": sum(d.words for d in docs)} for split, docs in splits.items()}}
        for name, splits in corpus.items()}}


def sources_markdown(corpus: dict[str, dict[str, list[Section]]], versions: dict[str, str], sizes: Sizes) -> str:
    lines = [
        "# hf_tangent mixed-domain corpus",
        "",
        "English prose from Debian packages, one folder per domain, split by document into train/ and",
        f"heldout/ (hf_tangent.training.corpora). Train text is capped at {sizes.train_max_words:,} words per domain,",
        f"held-out text at {sizes.heldout_max_words:,}; no paragraph appears twice within a domain. The austen domain is",
        "read from hf_tangent's Austen folder (HF_TANGENT_AUSTEN_DIR) and is not in this folder.",
        "",
        "| domain | package | version | licence | train docs | train words | held-out docs | held-out words |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, splits in corpus.items():
        domain = DOMAINS[name]
        train, heldout = splits["train"], splits["heldout"]
        lines.append(f"| {name} | {domain.package} | {versions.get(domain.package, '?')} | {domain.licence} | "
                     f"{len(train)} | {sum(d.words for d in train):,} | {len(heldout)} | "
                     f"{sum(d.words for d in heldout):,} |")
    lines += ["", *(f"- {name}: {DOMAINS[name].description}." for name in corpus), ""]
    return "\n".join(lines)


# --- Debian: apt-get download, dpkg-deb -x ----------------------------------------------------------

# A package whose content is in a dependency named like this (python3-doc -> python3.11-doc).
_CONTENT_DEPENDENCY = {"python3-doc": re.compile(r"python3\.\d+-doc")}


def _missing_tools_error() -> RuntimeError:
    packages = ", ".join(DOMAINS[name].package for name in CORPUS_DOMAINS)
    return RuntimeError(
        f"hf_tangent: the mixed-domain corpus is read out of the Debian packages {packages}, but apt-get/dpkg-deb "
        f"are not available here. Build it on a Debian or Ubuntu machine (python -c \"from "
        f"hf_tangent.training.corpora import corpus_dir; print(corpus_dir())\") and copy the folder here, "
        f"then set {CORPUS_ENV} to it."
    )


def _download(package: str, folder: Path) -> tuple[Path, str]:
    """The package's .deb in `folder`, and its version (from the file name)."""
    result = subprocess.run(["apt-get", "download", package], cwd=folder, capture_output=True, text=True)
    debs = sorted(folder.glob(f"{package}_*.deb"))
    if result.returncode != 0 or not debs:
        raise RuntimeError(
            f"hf_tangent: `apt-get download {package}` failed (run `apt-get update` first, or set {CORPUS_ENV} "
            f"to a corpus folder built elsewhere):\n{result.stderr.strip()}"
        )
    return debs[0], unquote(debs[0].name.split("_")[1])  # name_version_arch.deb; an epoch's ':' is %3a


def extract_packages(folder: Path) -> tuple[Path, dict[str, str]]:
    """Downloads every corpus package into `folder` and extracts them all into folder/root (one tree,
    as installed). Returns the root and package -> version ("python3-doc" names the version of the
    pythonX.Y-doc package that holds the pages)."""
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise _missing_tools_error()
    root = folder / "root"
    versions = {}
    for name in CORPUS_DOMAINS:
        package = DOMAINS[name].package
        deb, version = _download(package, folder)
        if package in _CONTENT_DEPENDENCY:
            depends = subprocess.run(["dpkg-deb", "-f", str(deb), "Depends"], capture_output=True, text=True,
                                     check=True).stdout
            found = _CONTENT_DEPENDENCY[package].search(depends)
            if found is None:
                raise RuntimeError(f"hf_tangent: {package} {version} depends on no {_CONTENT_DEPENDENCY[package].pattern}"
                                   f" package (Depends: {depends.strip()}); set {CORPUS_ENV} instead.")
            deb, content_version = _download(found.group(0), folder)
            version = f"{found.group(0)} {content_version}"
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
        versions[package] = version
    return root, versions
