"""The mixed-domain corpus (hf_tangent.training.corpora): each reader on kept excerpts of the real
Debian files (tests/data/corpora), the cleaning rules, the by-document split, and the API's refusals.
Nothing here needs apt or a network, except the one test marked `network` (real extraction)."""

import hashlib
import html
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import AUSTEN

from hf_tangent.training import corpora
from hf_tangent.training.corpora import clean, debian
from hf_tangent.training.data import AUSTEN_SPLITS

DATA = Path(__file__).resolve().parent / "data" / "corpora"
ROOT = DATA / "root"  # what `dpkg-deb -x` of the five packages gives, cut down (make_excerpts.py)
PYTHON = ROOT / "usr/share/doc/python3.11/html"
HANDBOOK = ROOT / "usr/share/doc/debian-handbook/html/en-US"
GNU = ROOT / "usr/share/doc/gnu-standards"
# Document sizes for the excerpts (a few hundred words a domain); the real corpus uses Sizes().
SMALL = debian.Sizes(document_words=300, min_document_words=50, heldout_min_words=0,
                     heldout_max_words=10**9, train_max_words=10**9)


def rendered(sections: list[clean.Section]) -> str:
    """The layout of tests/data/corpora/expected/<domain>.txt."""
    return "".join(f"# {s.doc_id} ({s.group})\n\n" + "".join(p + "\n\n" for p in s.paragraphs) for s in sections)


def p_elements(fragment: str) -> list[str]:
    """The text of every <p>...</p> with at least 8 words, by regular expressions: a second,
    independent reading of simple pages."""
    texts = [" ".join(html.unescape(re.sub(r"<[^>]+>", "", p)).split())
             for p in re.findall(r"<p>(.*?)</p>", fragment, flags=re.S)]
    return [t for t in texts if len(t.split()) >= 8]


def pre_texts(page: str) -> list[str]:
    return [" ".join(html.unescape(re.sub(r"<[^>]+>", "", p)).split())
            for p in re.findall(r"<pre[^>]*>(.*?)</pre>", page, flags=re.S)]


@pytest.fixture
def built(tmp_path):
    """The corpus of the kept excerpts, built as corpus_dir() builds the real one."""
    corpus = debian.build_corpus(ROOT, tmp_path, {"python3-doc": "python3.11-doc 3.11.2-6+deb12u8"}, SMALL)
    return tmp_path, corpus


# --- readers -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("domain", debian.CORPUS_DOMAINS)
def test_each_reader_gives_the_expected_prose(domain):
    """The excerpts' prose, exactly as reviewed by hand into tests/data/corpora/expected/."""
    expected = (DATA / "expected" / f"{domain}.txt").read_text(encoding="utf-8")
    assert rendered(debian.READERS[domain](ROOT)) == expected


def test_python_pages_keep_their_paragraphs_and_drop_code_and_navigation():
    page = (PYTHON / "tutorial/interpreter.html").read_text(encoding="utf-8")
    sections = {s.doc_id: s for s in debian.read_python(ROOT)}
    assert list(sections) == ["tutorial-interpreter", "faq-installed"]
    paragraphs = sections["tutorial-interpreter"].paragraphs
    main = page[page.index('role="main"'):page.index('class="sphinxsidebar"')]
    assert paragraphs == p_elements(main)  # every prose <p> of the body, in order, nothing else
    text = "\n".join(paragraphs)
    code = [c for c in pre_texts(page) if len(c.split()) > 1]  # (one is "python3.11", also a word of the prose)
    assert len(code) == 2 and not any(c in text for c in code)
    for navigation in ("Table of Contents", "Previous topic", "Report a Bug", "Quick search", "Please donate",
                       "Python Software Foundation"):
        assert navigation in page and navigation not in text


def test_handbook_pages_drop_screens_sidebar_titles_and_navigation():
    page = (HANDBOOK / "sect.apt-file.html").read_text(encoding="utf-8")
    text = "\n".join(s for section in debian.read_debian_handbook(ROOT) for s in section.paragraphs)
    screens = pre_texts(page)
    assert screens and not any(screen in text for screen in screens)
    for navigation in ("Download the ebook", "Prev", "Next", "The Debian Administrator's Handbook"):
        assert navigation in page and navigation not in text
    assert "apt-file search pattern will list all packages" in text  # <code> inside prose stays


def test_texinfo_sections_skip_the_title_page_contents_examples_licence_and_index():
    page = (GNU / "standards.html").read_text(encoding="utf-8")
    sections = debian.read_gnu_standards(ROOT)
    by_id = {s.doc_id: s for s in sections}
    # one section per node, grouped by chapter; texinfo's _002d is the "-" it stands for
    assert [(s.doc_id, s.group) for s in sections[:5]] == [
        ("standards-Preface", "standards-Preface"), ("standards-Legal-Issues", "standards-Legal-Issues"),
        ("standards-Reading-Non-Free-Code", "standards-Legal-Issues"),
        ("standards-Design-Advice", "standards-Design-Advice"), ("standards-Standard-C", "standards-Design-Advice")]
    node = page[page.index('id="Reading-Non_002dFree-Code"'):page.index('<div class="chapter" id="Design-Advice"')]
    navigation = re.compile(r'<div class="header">.*?</div>', flags=re.S)  # "Next: ..., Up: ..."
    assert by_id["standards-Reading-Non-Free-Code"].paragraphs == p_elements(navigation.sub("", node))
    text = "\n".join(p for s in sections for p in s.paragraphs)
    for left_out in ("Permission is granted to copy", "The purpose of this License", "Table of Contents",
                     "Referring to Proprietary Programs", "Jump to:", "int foo (int, int);", "Next:"):
        assert left_out in page and left_out not in text, left_out
    assert not any(code in text for code in pre_texts(page))


def test_jargon_keeps_body_text_and_headwords_and_drops_examples_and_the_lexicon_contents():
    sections = debian.read_jargon(ROOT)
    text = "\n".join(p for s in sections for p in s.paragraphs)
    baroque = next(s for s in sections if s.doc_id == "lexicon-baroque")
    assert baroque.group == "lexicon" and baroque.paragraphs[0].startswith(
        "baroque: [common] Feature-encrusted; complex; gaudy; verging on excessive. Said of hardware")
    assert "connotations of elephantine or monstrosity" in text  # {cross-references} lose their braces
    assert "{" not in text and "}" not in text
    assert "relevant excerpt" not in text  # quoted mail, indented by non-breaking spaces
    assert "Real Programmers write in FORTRAN." not in text  # a quotation, indented deeper
    assert "404 compliant" not in text  # the lexicon's table of contents
    assert [s.group for s in sections if s.doc_id.startswith("lexicon-")] == ["lexicon"] * 11


def test_dictionary_entries_lose_pronunciation_etymology_quotations_and_sources():
    abandon = next(p for s in debian.read_gcide(ROOT) for p in s.paragraphs if p.startswith("Abandon, v. t."))
    assert abandon.startswith("Abandon, v. t. 1. To cast or drive out; to banish; to expel; to reject. 2. To give "
                              "up absolutely;")
    assert abandon.endswith("It may be used either in a good or in a bad sense.")
    for left_out in ("\\", "[", "Udall", "That he might", "Syn:", "Usage:", "1913 Webster", "OF. abandoner"):
        assert left_out not in abandon
    entry = ("Necrotomy \\Ne*crot\"o*my\\, n. [Necro- + Gr. ? a cutting.] (Med.)\n"
             "   The dissection of dead bodies; also, excision of necrosed\n"
             "   bone. -- Nec`ro*tom\"ic, a. -- Ne*crot\"o*mist, n.\n   [1913 Webster]\n")
    assert clean.dictionary_entry(entry) == ("Necrotomy, n. (Med.) The dissection of dead bodies; also, excision of "
                                             "necrosed bone. -- Necrotomic, a. -- Necrotomist, n.")
    assert clean.dictionary_entry("Cafe \\Ca*f['e]\\, n.\n   A coffee house; a restaurant in the manner of a "
                                  "Com['e]die caf['e].\n   [1913 Webster] Stray\n") == (
        "Cafe, n. A coffee house; a restaurant in the manner of a Comédie café.")
    text = "\n".join(p for s in debian.read_gcide(ROOT) for p in s.paragraphs)
    assert "Mesquite" not in text and "database" not in text.lower()  # a stray headword; the 00-database notices


def test_dictd_index_numbers_and_entries():
    assert [clean.dictd_number(s) for s in ("A", "BS", "2i", "/")] == [0, 82, 54 * 64 + 34, 63]
    index = "beta\tF\tD\nalpha\tA\tF\nAlpha\tA\tF\n"  # two headwords share the entry at 0
    assert clean.dictd_entries(index, b"alphabeta") == [("alpha", "alpha"), ("beta", "bet")]


# --- cleaning rules --------------------------------------------------------------------------------------


def test_html_paragraphs_keep_prose_and_drop_code_tables_and_navigation():
    page = """<html><head><title>A title that is long enough to be a paragraph of prose</title></head><body>
    <nav><p>Home and about and contact and more links in the navigation bar</p></nav>
    <p>The first paragraph has enough words to count as prose, with an &amp; entity.<br>And a line break.
    <div class="sidebar"><p>A box of side remarks that the rules of this page drop entirely.</p></div>
    <pre>for line in the_file: print(line, end="")  # code, however wordy it is</pre>
    <p><code>a_function(with, many, arguments, that, are, all, code)</code> only.</p>
    <table><tr><td>A table cell with a sentence that is long enough to be prose.</td></tr></table>
    <ul><li>A list item written as a sentence is prose like any other paragraph.</li></ul>
    <p>Too short.</p><img src="x.png"><p>The last paragraph, unclosed like HTML allows, still counts here.
    </body></html>"""
    rules = clean.HtmlRules(skip_classes=frozenset({"sidebar"}))
    assert [text for _, text in clean.html_paragraphs(page, rules)] == [
        "The first paragraph has enough words to count as prose, with an & entity. And a line break.",
        "A list item written as a sentence is prose like any other paragraph.",
        "The last paragraph, unclosed like HTML allows, still counts here.",
    ]


def test_is_prose():
    assert clean.is_prose("Eight plain words make a paragraph of prose.")
    assert not clean.is_prose("Seven plain words are not quite enough.")
    assert not clean.is_prose("x = f(1, 2) + g[3] * 4 / 5 - 6 ** 7")  # mostly not letters
    assert not clean.is_prose("│ Version │ Date │ Lines │ Words │ Characters │ Entries │")
    assert not clean.is_prose("A paragraph with an undecodable byte \ufffd in it is dropped.")


def test_paragraphs_are_deduplicated_across_the_domain_then_sections_merged():
    shared = "A paragraph that two pages of the same manual both carry word for word."
    sections = [clean.Section("a", "one", [shared, "First page's own text " * 5]),
                clean.Section("b", "two", ["Second page's own text " * 5, shared]),
                clean.Section("c", "two", ["Third page's own text " * 30])]
    docs = debian.documents(sections, debian.Sizes(document_words=60, min_document_words=20))
    # the repeat goes from "b", the later one; "b" (20 words) is merged with "c" of its group
    assert [(d.doc_id, d.words) for d in docs] == [("a", 34), ("b", 20 + 120)]
    assert [p for d in docs for p in d.paragraphs].count(shared) == 1


def test_merge_sections_joins_small_sections_of_a_group_only():
    def section(doc_id, group, words):
        return clean.Section(doc_id, group, [" ".join(["w"] * words)])

    merged = clean.merge_sections([section("a", "x", 30), section("b", "x", 40), section("c", "x", 80),
                                   section("d", "x", 10), section("e", "y", 5)], min_words=60)
    # a+b reach 70; c alone 80, and d (10, the group's remainder) joins it; e is alone in its group
    assert [(s.doc_id, s.group, s.words) for s in merged] == [("a", "x", 70), ("c", "x", 90), ("e", "y", 5)]


def test_slug():
    assert clean.slug("Non-GNU Standards/1.2 (é)") == "Non-GNU-Standards-1.2-e"
    assert clean.slug("/dev/null") == "dev-null" and clean.slug("???") == "x"


# --- the split ---------------------------------------------------------------------------------------------


def synthetic_documents(n: int = 40) -> list[clean.Section]:
    return [clean.Section(f"doc-{i}", f"doc-{i}", [" ".join([f"w{i}"] * (100 + 37 * (i % 7)))]) for i in range(n)]


def test_split_is_by_document_in_hash_order_and_deterministic():
    docs = synthetic_documents()
    sizes = debian.Sizes(heldout_min_words=0)
    split = debian.split_documents("demo", docs, sizes)
    assert debian.split_documents("demo", list(reversed(docs)), sizes) == split  # order of input is irrelevant
    ranked = sorted(docs, key=lambda d: hashlib.sha256(f"demo/{d.doc_id}".encode()).hexdigest())
    total = sum(d.words for d in docs)
    count, words = 0, 0
    while words < 0.2 * total:  # the shortest prefix of the ranking with a fifth of the words
        words += ranked[count].words
        count += 1
    assert split["heldout"] == ranked[:count] and split["train"] == ranked[count:]
    other = debian.split_documents("other", docs, sizes)  # the domain is part of the hash
    assert {d.doc_id for d in other["heldout"]} != {d.doc_id for d in split["heldout"]}


def test_split_minimum_maximum_and_training_cap():
    docs = synthetic_documents()
    total = sum(d.words for d in docs)
    at_least = debian.split_documents("demo", docs, debian.Sizes(heldout_min_words=total // 2))
    assert total // 2 <= sum(d.words for d in at_least["heldout"]) < total // 2 + 400
    capped = debian.split_documents("demo", docs, debian.Sizes(heldout_min_words=0, heldout_max_words=500,
                                                                train_max_words=1000))
    heldout_words = [d.words for d in capped["heldout"]]
    train_words = [d.words for d in capped["train"]]
    assert sum(heldout_words[:-1]) < 500 <= sum(heldout_words)  # stops at the first document past the cap
    assert sum(train_words[:-1]) < 1000 <= sum(train_words)
    two = debian.split_documents("demo", docs[:2], debian.Sizes(heldout_min_words=10**6))
    assert len(two["heldout"]) == 1 and len(two["train"]) == 1  # one document always stays for training
    with pytest.raises(ValueError, match="domain 'demo' has 1 document"):
        debian.split_documents("demo", docs[:1])


def test_built_corpus_has_every_domain_and_split_and_no_paragraph_in_both(built):
    folder, corpus = built
    for name in debian.CORPUS_DOMAINS:
        splits = {split: sorted((folder / name / split).glob("*.txt")) for split in debian.SPLITS}
        assert splits["train"] and splits["heldout"], name
        paragraphs = {split: [p for f in files for p in f.read_text(encoding="utf-8").strip().split("\n\n")]
                      for split, files in splits.items()}
        assert not set(paragraphs["train"]) & set(paragraphs["heldout"]), name
        for split, docs in corpus[name].items():  # the files are the documents, paragraphs by blank lines
            assert {f.stem for f in splits[split]} == {d.doc_id for d in docs}
            assert paragraphs[split] == [p for d in sorted(docs, key=lambda d: d.doc_id) for p in d.paragraphs]
        # every document of the domain (the caps are off here) is in one split or the other
        assert sorted(d.doc_id for docs in corpus[name].values() for d in docs) == sorted(
            d.doc_id for d in debian.documents(debian.READERS[name](ROOT), SMALL))
    sources = (folder / "SOURCES.md").read_text(encoding="utf-8")
    python = corpus["python"]
    assert (f"| python | python3-doc | python3.11-doc 3.11.2-6+deb12u8 | {debian.DOMAINS['python'].licence} | "
            f"{len(python['train'])} | {sum(d.words for d in python['train']):,} | {len(python['heldout'])} | "
            f"{sum(d.words for d in python['heldout']):,} |") in sources
    assert "| jargon | jargon-text | ? | public domain |" in sources


# --- the API ----------------------------------------------------------------------------------------------


def test_domains_name_package_licence_and_description():
    assert list(corpora.DOMAINS) == ["austen", "python", "gnu", "debian", "dictionary", "jargon"]
    assert corpora.DOMAINS["austen"].package == "r-cran-janeaustenr"
    assert corpora.DOMAINS["dictionary"] == corpora.Domain(
        "dictionary", "dict-gcide", "GPL-2+",
        "GCIDE, the Collaborative International Dictionary of English (Webster's 1913 and WordNet definitions)")
    with pytest.raises(AttributeError):
        corpora.DOMAINS["gnu"].licence = "none"  # frozen


def test_documents_from_the_corpus_folder_and_austen(built, monkeypatch):
    folder, _ = built
    monkeypatch.setenv("HF_TANGENT_CORPUS_DIR", str(folder))
    assert corpora.corpus_dir() == folder
    files = sorted((folder / "gnu" / "heldout").glob("*.txt"))
    assert corpora.domain_documents("gnu", "heldout") == [f.read_text(encoding="utf-8") for f in files]
    novels = [(AUSTEN / f"{name}.txt").read_text(encoding="utf-8") for name in AUSTEN_SPLITS["calibration"]]
    assert corpora.domain_documents("austen", "train") == novels
    mixed = corpora.mixed_documents("heldout")
    assert list(mixed) == list(corpora.DOMAINS)
    assert mixed["austen"] == [(AUSTEN / f"{n}.txt").read_text(encoding="utf-8") for n in AUSTEN_SPLITS["evaluation"]]
    assert list(corpora.mixed_documents("train", ["jargon", "austen"])) == ["jargon", "austen"]


def test_unknown_domain_or_split_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown corpus domain 'klingon'; accepted: austen, python, gnu, debian, "
                                         "dictionary, jargon"):
        corpora.domain_documents("klingon", "train")
    with pytest.raises(ValueError, match="unknown corpus split 'test'; accepted: train, heldout"):
        corpora.domain_documents("python", "test")
    with pytest.raises(ValueError, match="unknown corpus split 'validation'; accepted: train, heldout"):
        corpora.mixed_documents("validation")
    with pytest.raises(ValueError, match="unknown corpus domain 'wiki'"):
        corpora.mixed_documents("train", ["austen", "wiki"])
    with pytest.raises(ValueError, match="not the string 'python'"):
        corpora.mixed_documents("train", "python")


def test_corpus_dir_override_lacking_a_domain_is_refused(built, monkeypatch):
    folder, _ = built
    shutil.rmtree(folder / "jargon")
    (folder / "gnu" / "heldout" / "x.md").write_text("not a document")
    for doc in (folder / "gnu" / "heldout").glob("*.txt"):
        doc.unlink()
    monkeypatch.setenv("HF_TANGENT_CORPUS_DIR", str(folder))
    with pytest.raises(FileNotFoundError, match=rf"HF_TANGENT_CORPUS_DIR={re.escape(str(folder))} lacks documents "
                                                r"\(<domain>/<split>/\*.txt\) for gnu/heldout, jargon/train, "
                                                r"jargon/heldout"):
        corpora.corpus_dir()


def test_without_apt_the_error_names_the_override(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TANGENT_CORPUS_DIR", raising=False)
    monkeypatch.setenv("HF_TANGENT_CACHE", str(tmp_path))
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="apt-get/dpkg-deb are not available here.*set HF_TANGENT_CORPUS_DIR"):
        corpora.corpus_dir()
    assert list(tmp_path.glob("corpus/*")) == []  # nothing half-made is left behind


def test_a_failed_download_names_the_package_and_the_override(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TANGENT_CORPUS_DIR", raising=False)
    monkeypatch.setenv("HF_TANGENT_CACHE", str(tmp_path))
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")

    def apt_get(command, **kwargs):
        assert command == ["apt-get", "download", "python3-doc"]
        return subprocess.CompletedProcess(command, 100, "", "E: Unable to locate package python3-doc")

    monkeypatch.setattr(debian.subprocess, "run", apt_get)
    with pytest.raises(RuntimeError, match=r"`apt-get download python3-doc` failed \(run `apt-get update` first, "
                                           r"or set HF_TANGENT_CORPUS_DIR.*\n.*Unable to locate package python3-doc"):
        corpora.corpus_dir()
    assert list(tmp_path.glob("corpus/*")) == []  # nothing half-made is left behind


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.skipif(shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None, reason="needs apt-get")
def test_real_extraction_gives_every_domain_enough_heldout_text(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TANGENT_CORPUS_DIR", raising=False)
    monkeypatch.setenv("HF_TANGENT_CACHE", str(tmp_path))
    folder = corpora.corpus_dir()
    assert folder == tmp_path / "corpus" / corpora.CORPUS_VERSION
    sizes = debian.Sizes()
    for name in debian.CORPUS_DOMAINS:
        words = {split: sum(len(d.split()) for d in corpora.domain_documents(name, split)) for split in debian.SPLITS}
        assert words["heldout"] >= sizes.heldout_min_words, (name, words)
        assert words["train"] < sizes.train_max_words + 20_000, (name, words)  # the cap, give or take a document
        paragraphs = {split: {p for d in corpora.domain_documents(name, split) for p in d.split("\n\n")}
                      for split in debian.SPLITS}
        assert not paragraphs["train"] & paragraphs["heldout"], name
    sources = (folder / "SOURCES.md").read_text(encoding="utf-8")
    assert "| python | python3-doc | python3." in sources and "| ? |" not in sources


def test_a_killed_corpus_build_is_cleaned_by_the_next_one(tmp_path, monkeypatch):
    """A build killed midway left a hidden `.corpus-*` folder (tempfile.mkdtemp) that nothing removed. The cache is
    now built in the staged write's stage (destinations.build_cache): the next build removes what a dead one left,
    and a build that fails leaves nothing beside the cache."""
    monkeypatch.delenv("HF_TANGENT_CORPUS_DIR", raising=False)
    monkeypatch.setenv("HF_TANGENT_CACHE", str(tmp_path))
    target = tmp_path / "corpus" / corpora.CORPUS_VERSION
    killed = target.parent / f".{target.name}.hf_tangent-staging-0123abcd"
    (killed / "python" / "train").mkdir(parents=True)  # a killed build's half-written stage
    monkeypatch.setattr(corpora, "extract_packages", lambda folder: (ROOT, {}))
    stages = []

    def build(root, staging, versions, fail=False):
        stages.append(staging)
        if fail:
            raise RuntimeError("stopped while building")
        return debian.build_corpus(root, staging, versions, SMALL)

    monkeypatch.setattr(corpora, "build_corpus", lambda *a: build(*a, fail=True))
    with pytest.raises(RuntimeError, match="stopped while building"):
        corpora.corpus_dir()
    assert list(target.parent.iterdir()) == []  # the dead build's stage removed, the failed one's too
    monkeypatch.setattr(corpora, "build_corpus", build)
    assert corpora.corpus_dir() == target
    assert [p.name for p in target.parent.iterdir()] == [target.name] and not corpora._missing(target)
    assert all(s.parent == target.parent and s.name.startswith(f".{target.name}.hf_tangent-staging-") for s in stages)
