"""From markup to clean prose paragraphs: HTML pages, plain-text books, dictd dictionary entries.

Every reader ends in the same test, `is_prose`: a paragraph of at least `MIN_WORDS` words, mostly
letters, with no table rules. Code (`<pre>`, paragraphs mostly of `<code>`), navigation, tables of
contents, tables and indexes never reach it: the HTML parser skips those subtrees outright.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from html.parser import HTMLParser

MIN_WORDS = 8  # shorter paragraphs are headings, captions, labels
MIN_LETTER_FRACTION = 0.7  # of the non-space characters; English prose has ~0.8, code and numbers far less
MAX_CODE_FRACTION = 0.5  # a paragraph with more of its characters inside <code> is code, not prose

_VOID_TAGS = frozenset("area base br col embed hr img input link meta param source track wbr".split())
_BLOCK_TAGS = frozenset(
    "address article aside blockquote body dd div dl dt figcaption figure footer h1 h2 h3 h4 h5 h6 header hr "
    "li main ol p section td th tr ul".split())
# Never prose, whatever the page: code, tables, navigation, forms, metadata.
_SKIP_TAGS = frozenset("button form head nav pre script select style svg table textarea title".split())
_CODE_TAGS = frozenset("code kbd samp tt".split())


def normalise(text: str) -> str:
    """One line, single spaces (non-breaking and other Unicode spaces too)."""
    return " ".join(text.split())


def is_prose(paragraph: str) -> bool:
    """At least MIN_WORDS words, mostly letters, and no box-drawing (text tables) or undecodable bytes."""
    if len(paragraph.split()) < MIN_WORDS or "\ufffd" in paragraph:
        return False
    if any("\u2500" <= c <= "\u257f" for c in paragraph):
        return False
    visible = [c for c in paragraph if not c.isspace()]
    return sum(c.isalpha() for c in visible) >= MIN_LETTER_FRACTION * len(visible)


@dataclass
class Section:
    """Consecutive paragraphs of one source section; `group` is the larger unit (file, chapter) that
    small sections may be merged within, `doc_id` names the document (a file name, no slashes)."""

    doc_id: str
    group: str
    paragraphs: list[str] = field(default_factory=list)

    @property
    def words(self) -> int:
        return sum(len(p.split()) for p in self.paragraphs)


def merge_sections(sections: Iterable[Section], min_words: int) -> list[Section]:
    """Consecutive sections of one group joined until each has at least `min_words` words.

    A short remainder at the end of a group joins the document before it; a group too small for
    even one document stays one short document (the caller drops it if it is tiny)."""
    merged: list[Section] = []
    current: Section | None = None
    for section in sections:
        if current is not None and current.group != section.group:
            _close(merged, current, min_words)
            current = None
        if current is None:
            current = Section(section.doc_id, section.group, list(section.paragraphs))
        else:
            current.paragraphs.extend(section.paragraphs)
        if current.words >= min_words:
            merged.append(current)
            current = None
    if current is not None:
        _close(merged, current, min_words)
    return merged


def _close(merged: list[Section], rest: Section, min_words: int) -> None:
    if rest.words < min_words and merged and merged[-1].group == rest.group:
        merged[-1].paragraphs.extend(rest.paragraphs)
    elif rest.paragraphs:
        merged.append(rest)


def slug(text: str) -> str:
    """A file-name-safe id: letters, digits, dots, dashes, underscores."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "x"


# --- HTML -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HtmlRules:
    """What of a page is prose: the root element(s) to read (None: the whole body), what to skip,
    and which elements open a section (returning its id) for pages that hold many sections."""

    skip_classes: frozenset[str] = frozenset()
    skip_ids: frozenset[str] = frozenset()
    root: Callable[[str, dict[str, str]], bool] | None = None
    section: Callable[[str, dict[str, str]], str | None] | None = None


@dataclass
class _Element:
    tag: str
    skipped: bool
    in_root: bool
    in_code: bool
    section: tuple[str, ...]


class _ProseParser(HTMLParser):
    """Collects the text of block elements as paragraphs, each with the path of section ids it is in."""

    def __init__(self, rules: HtmlRules):
        super().__init__(convert_charrefs=True)
        self.rules = rules
        self.stack: list[_Element] = [_Element("", False, rules.root is None, False, ())]
        self.paragraphs: list[tuple[tuple[str, ...], str]] = []
        self._text: list[str] = []
        self._code_chars = 0
        self._section: tuple[str, ...] = ()

    def _skips(self, tag: str, attrs: dict[str, str]) -> bool:
        classes = set(attrs.get("class", "").split())
        return (tag in _SKIP_TAGS or attrs.get("role") == "navigation" or bool(classes & self.rules.skip_classes)
                or attrs.get("id", "") in self.rules.skip_ids)

    def handle_starttag(self, tag: str, attr_list: list[tuple[str, str | None]]) -> None:
        attrs = {k: v or "" for k, v in attr_list}
        if tag in _BLOCK_TAGS:
            self._flush()
        if tag in _VOID_TAGS:
            if tag == "br":
                self.handle_data(" ")
            return
        parent = self.stack[-1]
        section = parent.section
        if self.rules.section is not None and not parent.skipped:
            opened = self.rules.section(tag, attrs)
            section = section + (opened,) if opened is not None else section
        in_root = parent.in_root or (self.rules.root is not None and self.rules.root(tag, attrs))
        skipped = parent.skipped or self._skips(tag, attrs)
        self.stack.append(_Element(tag, skipped, in_root, parent.in_code or tag in _CODE_TAGS, section))

    def handle_startendtag(self, tag: str, attr_list: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attr_list)
        if tag not in _VOID_TAGS:
            self.handle_endtag(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in _BLOCK_TAGS:
            self._flush()
        # Close up to the matching open element; an end tag with no open element is stray markup.
        for depth in range(len(self.stack) - 1, 0, -1):
            if self.stack[depth].tag == tag:
                del self.stack[depth:]
                return

    def handle_data(self, data: str) -> None:
        top = self.stack[-1]
        if top.skipped or not top.in_root:
            return
        if not self._text:
            self._section = top.section
        self._text.append(data)
        if top.in_code:
            self._code_chars += sum(not c.isspace() for c in data)

    def _flush(self) -> None:
        text = normalise("".join(self._text))
        visible = sum(not c.isspace() for c in text)
        if text and self._code_chars <= MAX_CODE_FRACTION * visible:
            self.paragraphs.append((self._section, text))
        self._text, self._code_chars = [], 0

    def close(self) -> None:
        super().close()
        self._flush()


def html_paragraphs(html: str, rules: HtmlRules = HtmlRules()) -> list[tuple[tuple[str, ...], str]]:
    """(section path, paragraph) for every prose paragraph of a page, in page order."""
    parser = _ProseParser(rules)
    parser.feed(html)
    parser.close()
    return [(path, text) for path, text in parser.paragraphs if is_prose(text)]


# --- plain text (the Jargon File) ------------------------------------------------------------------


def text_paragraphs(lines: Iterable[str], indent: int) -> list[str]:
    """Blank-line separated paragraphs whose lines are all indented by exactly `indent` spaces (the
    body text); more deeply indented blocks (also by non-breaking spaces) are examples, verse or
    quoted mail, and are dropped."""
    paragraphs, block = [], []
    for line in [*lines, ""]:
        if line.strip():
            block.append(line)
            continue
        if block and all(len(b) - len(b.lstrip()) == indent for b in block):
            paragraph = normalise(" ".join(block))
            if is_prose(paragraph):
                paragraphs.append(paragraph)
        block = []
    return paragraphs


# --- dictd entries (GCIDE, from Webster's 1913 and WordNet) ----------------------------------------

# Webster's 1913 transcription codes for accented letters: [`e] [^e] [=e] ['e] [~n] [.a] [ae] ...
_COMBINING = {"'": "\u0301", "`": "\u0300", "^": "\u0302", "~": "\u0303", "=": "\u0304", ".": "\u0307", '"': "\u0308"}
_ACCENT = re.compile(r"\[([`'^~=.\"])([A-Za-z])\]")
_BREVE = re.compile(r"\[([A-Za-z])\^\]")  # [a^], [i^]
_UMLAUT = re.compile(r"\[([A-Za-z])um\]")
_NAMED = {"[ae]": "æ", "[AE]": "Æ", "[oe]": "œ", "[OE]": "Œ", "[cced]": "ç", "[,c]": "ç", "[imac]": "ī",
          "[eth]": "ð", "[thorn]": "þ", "[deg]": "°", "[sect]": "§"}  # other codes go with the brackets
# [1913 Webster], [PJC], [WordNet 1.5], [Obs.] alone on a line (GCIDE sometimes leaves a stray word after it)
_SOURCE_LINE = re.compile(r"^\s*\[[^\[\]]*\](\s+\S+)?\s*$")
_SENSE_MARK = re.compile(r"^\s*(\d+\.|\([a-z]\))\s")
# \Ha`gi*ol"o*gy\ and the respelling after it, (-j[y^]) or (?; 135); a derived form's own respelling (-j[i^]st)
_PRONUNCIATION = re.compile(r"\\[^\\\n]*\\(\s*\([^()\n]*\))?|\(-[^()\s]*\)")
_SYLLABLE_MARKS = re.compile(r"(?<=[^\W\d_])[`*\"](?=[^\W\d_])")  # Nec`ro*tom"ic -> Necrotomic
# "--Shak.", "--Ham. Nav. Encyc." up to the line's end or a derived form's " -- " (not "-- often")
_ATTRIBUTION = re.compile(r"\s--(?=[A-Z])[^\n]*?(?=\s--\s|$)", re.MULTILINE)
_INNER_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_BRACES = re.compile(r"[{}]")
_SPACE_BEFORE_PUNCTUATION = re.compile(r"\s+([,.;:])")
_QUOTE_INDENT = 8  # senses are indented 3 (continued at 6, sub-senses 6 and 10); quotations 12 and more


def _decode_accents(text: str) -> str:
    for code, letter in _NAMED.items():
        text = text.replace(code, letter)
    text = _ACCENT.sub(lambda m: unicodedata.normalize("NFC", m.group(2) + _COMBINING[m.group(1)]), text)
    text = _BREVE.sub(lambda m: unicodedata.normalize("NFC", m.group(1) + "\u0306"), text)
    return _UMLAUT.sub(lambda m: unicodedata.normalize("NFC", m.group(1) + "\u0308"), text)


def dictionary_entry(entry: str) -> str:
    """One GCIDE entry as one paragraph: headword, part of speech and definitions, without the
    pronunciation, etymology, source tags, quotations (citations of authors) and synonym lists."""
    kept: list[str] = []
    segment: list[str] = []
    for line in [*entry.splitlines(), ""]:
        if line.strip() and not _SOURCE_LINE.match(line):
            segment.append(line)
            continue
        if segment:
            first = segment[0]
            quotation = len(first) - len(first.lstrip()) >= _QUOTE_INDENT and not _SENSE_MARK.match(first)
            if not quotation and not first.lstrip().startswith("Syn:"):
                kept.append(re.sub(r"^\s*(Note|Usage):\s*", "", "\n".join(segment)))
        segment = []
    text = _decode_accents("\n".join(kept))
    text = _SYLLABLE_MARKS.sub("", _PRONUNCIATION.sub("", text))
    text = _ATTRIBUTION.sub("", text)
    while _INNER_BRACKETS.search(text):  # etymologies nest codes: [OE. tre['o]w. See {True}.]
        text = _INNER_BRACKETS.sub("", text)
    text = _BRACES.sub("", normalise(text))
    return _SPACE_BEFORE_PUNCTUATION.sub(r"\1", text).strip()


_DICTD_DIGITS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def dictd_number(text: str) -> int:
    """An offset or length of a dictd .index line (base 64, most significant digit first)."""
    value = 0
    for digit in text:
        value = value * 64 + _DICTD_DIGITS.index(digit)
    return value


def dictd_entries(index: str, data: bytes) -> list[tuple[str, str]]:
    """(headword, entry text) for each distinct entry of a dictd dictionary, in file order; several
    headwords pointing at one entry give it once, under the first of them."""
    entries: dict[int, tuple[str, int]] = {}
    for line in index.splitlines():
        headword, offset, length = line.split("\t")
        entries.setdefault(dictd_number(offset), (headword, dictd_number(length)))
    return [(headword, data[offset:offset + length].decode("utf-8", errors="replace"))
            for offset, (headword, length) in sorted(entries.items())]
