"""A mixed-domain offline English corpus for calibration and healing, from Debian packages.

Six domains (`DOMAINS`): Jane Austen's novels (the corpus hf_tangent always had, from
r-cran-janeaustenr) and five kinds of prose that Debian ships as HTML or text: the Python tutorial,
HOWTOs and FAQ, the GNU coding standards, the Debian Administrator's Handbook, the GCIDE dictionary
and the Jargon File. Each domain is split by document into "train" and "heldout" (about 20 %), with
no paragraph in both, and each non-Austen domain's training text is capped at about 1 MB so that no
domain dominates a mix (debian.py says how).

    from hf_tangent.training.corpora import mixed_documents
    calibration = mixed_documents("train")      # {"austen": [...], "python": [...], ...}
    evaluation = mixed_documents("heldout", ["austen", "jargon"])

The non-Austen text is extracted once, on first use, with apt-get and dpkg-deb (a few seconds
after the 60 MB download) into the hf_tangent cache, or read from `$HF_TANGENT_CORPUS_DIR`: a
folder of <domain>/<split>/<doc id>.txt, as `corpus_dir()` writes it (with a SOURCES.md listing
packages, versions, licences and sizes).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ...artifacts.checkpoints import cache_dir
from ...core.destinations import build_cache
from .austen import AUSTEN_SPLITS, austen_dir, austen_source, check_text_files
from .debian import CORPUS_DOMAINS, CORPUS_ENV, DOMAINS, SPLITS, Domain, Sizes, build_corpus, extract_packages

__all__ = ["CORPUS_VERSION", "DOMAINS", "SPLITS", "Domain", "Sizes", "build_corpus", "corpus_dir",
           "domain_documents", "mixed_documents", "package_versions"]

CORPUS_VERSION = "1"  # bump when the extraction changes: it names the cache folder
# The Austen split names of data.py for this module's train / heldout.
_AUSTEN_SPLIT = {"train": "calibration", "heldout": "evaluation"}


def _missing(folder: Path) -> list[str]:
    """The <domain>/<split> folders of `folder` that hold no .txt document."""
    return [f"{name}/{split}" for name in CORPUS_DOMAINS for split in SPLITS
            if not any((folder / name / split).glob("*.txt"))]


def corpus_dir() -> Path:
    """The folder of <domain>/<split>/<doc id>.txt for every non-Austen domain: $HF_TANGENT_CORPUS_DIR,
    else cache_dir()/corpus/<CORPUS_VERSION>, extracted from Debian on first use."""
    override = os.environ.get(CORPUS_ENV)
    if override:
        missing = _missing(Path(override))
        if missing:
            raise FileNotFoundError(
                f"{CORPUS_ENV}={override} lacks documents (<domain>/<split>/*.txt) for {', '.join(missing)}; "
                f"it needs every domain of {', '.join(CORPUS_DOMAINS)} with both splits {', '.join(SPLITS)}."
            )
        return Path(override)
    target = cache_dir() / "corpus" / CORPUS_VERSION
    missing = _missing(target)
    if missing and target.exists() and any(target.iterdir()):  # not ours to delete: say what is wrong instead
        raise FileNotFoundError(f"the corpus cache {target} is incomplete (no documents for {', '.join(missing)}); "
                                "delete that folder to extract the corpus again, or set "
                                f"{CORPUS_ENV} to a complete copy.")
    if missing:
        _extract(target)
    return target


def _extract(target: Path) -> None:
    """Downloads, reads and splits the packages into a staging folder, then moves it in place in one step."""
    with tempfile.TemporaryDirectory() as tmp:
        root, versions = extract_packages(Path(tmp))
        build_cache(target, lambda staging: build_corpus(root, staging, versions), lambda folder: not _missing(folder))


def domain_documents(domain: str, split: str) -> list[str]:
    """The documents (one string each) of one domain and split ("train" or "heldout"). Austen's
    train split is the calibration novels and its held-out split the evaluation novels (data.py)."""
    if not isinstance(domain, str) or domain not in DOMAINS:
        raise ValueError(f"unknown corpus domain {domain!r}; accepted: {', '.join(DOMAINS)}.")
    if not isinstance(split, str) or split not in SPLITS:
        raise ValueError(f"unknown corpus split {split!r}; accepted: {', '.join(SPLITS)}.")
    if domain == "austen":
        folder = austen_dir()
        files = [str(folder / f"{novel}.txt") for novel in AUSTEN_SPLITS[_AUSTEN_SPLIT[split]]]
    else:
        files = [str(f) for f in sorted((corpus_dir() / domain / split).glob("*.txt"))]
    check_text_files(files)
    return [Path(f).read_text(encoding="utf-8") for f in files]


def mixed_documents(split: str, domains: Sequence[str] | None = None) -> dict[str, list[str]]:
    """Domain -> documents of one split, for `domains` (all, in DOMAINS order, by default)."""
    if not isinstance(split, str) or split not in SPLITS:
        raise ValueError(f"unknown corpus split {split!r}; accepted: {', '.join(SPLITS)}.")
    if domains is None:
        domains = list(DOMAINS)
    if isinstance(domains, str) or not isinstance(domains, Sequence):
        raise ValueError(f"domains must be a list of domain names (accepted: {', '.join(DOMAINS)}), not "
                         f"{'the string ' + repr(domains) if isinstance(domains, str) else type(domains).__name__}.")
    if not domains or len(set(map(str, domains))) != len(domains):
        raise ValueError(f"domains={list(domains)!r}: accepted: a non-empty list of distinct names among "
                         f"{', '.join(DOMAINS)}.")
    return {domain: domain_documents(domain, split) for domain in domains}


def package_versions(domains: Sequence[str]) -> dict[str, dict]:
    """Domain -> {"package", "version"}: the Debian package each domain's text was read from, as the
    corpus folder's sources.json (austen: its folder's source.json) records it; version None where
    nothing records it."""
    import json

    recorded = {}
    if any(domain != "austen" for domain in domains):
        try:
            recorded = json.loads((corpus_dir() / "sources.json").read_text(encoding="utf-8"))["domains"]
        except (OSError, ValueError, KeyError, TypeError):
            recorded = {}
    out = {}
    for domain in domains:
        if domain == "austen":
            out[domain] = austen_source()
        else:
            entry = recorded.get(domain) if isinstance(recorded, dict) else None
            out[domain] = {"package": DOMAINS[domain].package,
                           "version": entry.get("version") if isinstance(entry, dict) else None}
    return out
