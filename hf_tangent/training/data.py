"""Text for evaluation and calibration: the offline corpora (corpora/: the Austen novels, and the
mixed corpus of Debian's English prose), local files, hub datasets.

Calibration and evaluation text are split by document, never by lines, so they cannot overlap.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch

from ..artifacts.offline import HubUnavailableError, needs_hub
from ..ranges import check_ranges
from .corpora import DOMAINS, mixed_documents, package_versions
from .corpora.austen import (  # noqa: F401  (the names this module has always had)
    AUSTEN_NOVELS,
    AUSTEN_SPLITS,
    austen_dir,
    austen_files,
    check_text_files,
    read_r_lazyload,
)
from .extras import needs_recipes

# Hub datasets by short name: (path, config, text column). Users with a network only.
HUB_DATASETS = {
    "wikitext-2": ("Salesforce/wikitext", "wikitext-2-raw-v1", "text"),
    "wikitext-103": ("Salesforce/wikitext", "wikitext-103-raw-v1", "text"),
    "openwebtext-10k": ("stas/openwebtext-10k", None, "text"),
}


def load_documents(text_files: Sequence[str] | None = None, dataset: str | None = None, *,
                   split: str = "evaluation", dataset_split: str = "test", text_column: str | None = None) -> list[str]:
    """Documents (one string each) from local files, a hub dataset, or the Austen default split."""
    with needs_recipes("loading text documents"):
        import datasets

    if text_files and dataset:
        raise ValueError("pass either text files or a dataset, not both.")
    if dataset:
        path, name, column = HUB_DATASETS.get(dataset, (dataset, None, text_column or "text"))
        try:
            with needs_hub(f"the dataset {dataset!r} (a hub dataset)", "dataset"):
                ds = datasets.load_dataset(path, name, split=dataset_split)
        except HubUnavailableError:
            raise
        except Exception as err:  # an unknown name, or no such split: say which
            raise ValueError(
                f"could not load dataset {dataset!r} (split {dataset_split!r}): {err}. Short names: "
                f"{', '.join(HUB_DATASETS)}; without a network use --text-files."
            ) from err
        column = text_column or column
        if column not in ds.column_names:
            raise ValueError(f"dataset {dataset!r} has no column {column!r}; columns: {ds.column_names}.")
        # Line-per-row corpora (WikiText) form one document; the split is the hub's own.
        return ["\n".join(ds[column])]
    files = list(text_files) if text_files else austen_files(split)
    check_text_files(files)  # before datasets, whose error for a bad byte names neither file nor position
    ds = datasets.load_dataset("text", data_files=files, sample_by="document", split="train")
    docs = [d for d in ds["text"] if d.strip()]
    if not docs:
        raise ValueError(f"the text files {files} hold no text.")
    return docs


def pack_windows(tokenizer, documents: Sequence[str], seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Token windows (n, seq_len): documents tokenized, joined with EOS, cut into full blocks.

    Where the tokenizer itself starts every text with BOS (Gemma: without it the model's loss is
    ~1.3 nats higher), every window starts with BOS too, followed by seq_len - 1 text tokens."""
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len} is too short; a window needs at least 2 tokens.")
    if not documents or not any(d.strip() for d in documents):
        raise ValueError("no text to evaluate: the documents are empty.")
    needed = None if max_windows is None else max_windows * seq_len
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for doc in documents:
        ids.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
        if eos is not None:
            ids.append(eos)
        if needed is not None and len(ids) >= needed:
            break
    bos = _leading_bos(tokenizer)
    block = seq_len - (bos is not None)
    n = len(ids) // block
    if n == 0 or block < 1:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of seq_len={seq_len}.")
    if max_windows is not None:
        n = min(n, max_windows)
    windows = torch.tensor(ids[: n * block], dtype=torch.long).view(n, block)
    if bos is not None:
        windows = torch.cat([torch.full((n, 1), bos, dtype=torch.long), windows], dim=1)
    return windows  # (n, seq_len)


def _leading_bos(tokenizer) -> int | None:
    """The BOS id if the tokenizer puts it in front of every text it encodes, else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    probe = tokenizer("a")["input_ids"]
    return bos if probe and probe[0] == bos else None


def documents_digest(domains: dict[str, list[str]]) -> dict:
    """Domain -> {documents, characters, sha256 over the documents (UTF-8, each followed by a NUL)}."""
    out = {}
    for name, docs in domains.items():
        digest = hashlib.sha256()
        for doc in docs:
            digest.update(doc.encode("utf-8") + b"\0")
        out[name] = {"documents": len(docs), "characters": sum(map(len, docs)), "sha256": digest.hexdigest()}
    return out


@dataclass(frozen=True)
class TextSource:
    """Where evaluation and training text come from, and how reports name it (one place for both).

    Evaluation text: `text_files`, a hub `dataset` (its `dataset_split`), in-memory `documents`, or
    the held-out part of the offline `corpus`. Training / calibration text: `calibration_files`,
    in-memory `calibration_documents`, the dataset's train split, or the offline corpus's training
    part; with evaluation files only, training uses the first 80% of their documents and evaluation the rest.

    The offline corpus (where no text is given): "austen" (the Austen novels: calibration / held-out
    novels) or "mixed" (the novels and English prose from Debian packages, corpora/, each domain split
    by document into train / held-out); None is the recipe's default (`with_default_corpus`: heal
    takes "mixed", the others "austen"). `training_domains` / `evaluation_domains` give the
    documents per domain (one domain, named "text", for text the user gives)."""

    text_files: tuple[str, ...] | None = None
    dataset: str | None = None
    dataset_split: str = "test"
    calibration_files: tuple[str, ...] | None = None
    documents: tuple[str, ...] | None = None
    calibration_documents: tuple[str, ...] | None = None
    corpus: Literal["austen", "mixed"] | None = None

    def __post_init__(self):
        check_ranges(self)  # every field's type (ranges.py), as for every options object
        if self.corpus is not None and not self._offline_default:
            given = [n for n in ("text_files", "dataset", "documents", "calibration_files", "calibration_documents")
                     if getattr(self, n)]
            raise ValueError(f"corpus={self.corpus!r} is the offline text used where none is given, and "
                             f"{' and '.join(given)} given too; accepted: one or the other.")
        given = [n for n in ("text_files", "dataset", "documents") if getattr(self, n)]
        if len(given) > 1:
            raise ValueError(f"pass one evaluation text source, not {' and '.join(given)}.")
        if self.calibration_files and self.calibration_documents:
            raise ValueError("pass calibration_files or calibration_documents, not both.")
        overlap = set(map(os.path.abspath, self.calibration_files or ())) & set(map(os.path.abspath, self.text_files or ()))
        if overlap:
            raise ValueError(f"files used both for calibration and evaluation: {sorted(overlap)}.")

    @classmethod
    def of(cls, text) -> TextSource:
        """A TextSource as is, None (the defaults), or a sequence of documents to evaluate on."""
        if text is None:
            return cls()
        if isinstance(text, TextSource):
            return text
        if isinstance(text, str) or not all(isinstance(d, str) for d in text):
            raise ValueError("text must be a TextSource or a list of documents (strings).")
        return cls(documents=tuple(text))

    def with_default_corpus(self, corpus: Literal["austen", "mixed"]) -> TextSource:
        """This source, with `corpus` where none was chosen and no text is given (a recipe's default
        offline corpus)."""
        return replace(self, corpus=corpus) if self.corpus is None and self._offline_default else self

    @property
    def _offline_default(self) -> bool:
        return not any((self.text_files, self.dataset, self.documents, self.calibration_files, self.calibration_documents))

    @property
    def _mixed(self) -> bool:
        return self.corpus == "mixed" and self._offline_default

    def training_domains(self) -> dict[str, list[str]]:
        """Training text per domain: the mixed corpus's domains, {"austen": ...} by default, {"text": ...}
        for text the user gives."""
        if self._mixed:
            return mixed_documents("train")
        return {"austen" if self._offline_default else "text": self.training_documents()}

    def evaluation_domains(self, *, training: bool = False, every_domain: bool = False) -> dict[str, list[str]]:
        """Held-out text per domain (as training_domains); `every_domain`: the mixed corpus's held-out
        domains whenever the text is the offline default, whichever corpus trains (heal's report)."""
        if self._mixed or (every_domain and self._offline_default):
            return mixed_documents("heldout")
        return {"austen" if self._offline_default and not self.documents else "text":
                self.evaluation_documents(training=training)}

    @property
    def _own_training(self) -> bool:
        return bool(self.calibration_files or self.calibration_documents)

    def _refuse_mixed(self) -> None:
        if self._mixed:  # one list of documents: the first windows would all be the first domain's text
            raise ValueError("corpus='mixed' is one text per domain, windowed domain by domain; this recipe reads one "
                             "text. Accepted: the mixed corpus with heal, calibrate, finetune or eval (evaluate_rules), "
                             "or corpus='austen' or text of your own here.")

    def evaluation_documents(self, *, training: bool = False) -> list[str]:
        self._refuse_mixed()
        if self.documents:
            return list(self.documents)
        if self.dataset:
            return load_documents(dataset=self.dataset, dataset_split=self.dataset_split)
        if training and self.text_files and not self._own_training:
            return self._split_files()[0]
        return load_documents(self.text_files, split="evaluation")

    def training_documents(self) -> list[str]:
        """Calibration / training text, never overlapping the evaluation text."""
        self._refuse_mixed()
        if self.calibration_documents:
            return list(self.calibration_documents)
        if self.calibration_files:
            return load_documents(self.calibration_files)
        if self.dataset:
            return load_documents(dataset=self.dataset, dataset_split="train")
        if self.text_files:
            return self._split_files()[1]
        if self.documents:
            raise ValueError("in-memory evaluation documents need calibration_documents for training.")
        return load_documents(split="calibration")

    def _split_files(self) -> tuple[list[str], list[str]]:
        docs = load_documents(self.text_files)
        if len(docs) < 2:
            raise ValueError("training needs calibration text separate from the evaluation text: pass "
                             "calibration files, or at least two documents in the text files (split by document).")
        held_out = max(1, len(docs) // 5)
        return docs[-held_out:], docs[:-held_out]

    def describe(self, *, training: bool = False, every_domain: bool = False) -> str | dict[str, str]:
        """The provenance written into reports: a string, or {evaluation, calibration} with training;
        `every_domain` as in evaluation_domains."""
        files = " ".join(self.text_files or ())
        split = training and self.text_files and not self._own_training
        mixed = f"mixed ({', '.join(DOMAINS)})"
        every = self._mixed or (every_domain and self._offline_default)
        evaluation = ("user documents" if self.documents else f"{self.dataset}:{self.dataset_split}" if self.dataset
                      else f"{files} (last 20% of documents)" if split else files or (
                          f"{mixed}:heldout" if every else "austen:evaluation"))
        if not training:
            return evaluation
        calibration = ("user documents" if self.calibration_documents else " ".join(self.calibration_files)
                       if self.calibration_files else f"{self.dataset}:train" if self.dataset
                       else f"{files} (first 80% of documents)" if split else (
                           f"{mixed}:train" if self._mixed else "austen:calibration"))
        return {"evaluation": evaluation, "calibration": calibration}

    def provenance(self, *, training: bool = False, every_domain: bool = False,
                   read: dict[str, list[str] | dict[str, list[str]]] | None = None) -> dict:
        """What reports record of the text beside `describe`: per domain of the evaluation text (and with
        `training` of the training text) the number of documents and characters and a sha256 over the
        documents as read, and for the offline corpus the Debian package and version of each domain.
        `read`: {part: documents, or domain -> documents} that the experiment read itself, instead of reading again."""
        domain = "austen" if self._offline_default and not self._mixed else "text"
        if read is not None:
            found = {part: documents_digest(docs if isinstance(docs, dict) else {domain: docs})
                     for part, docs in read.items()}
        else:
            found = {"evaluation": documents_digest(self.evaluation_domains(training=training,
                                                                            every_domain=every_domain))}
            if training:
                found["training"] = documents_digest(self.training_domains())
        offline = sorted({d for part in found.values() for d in part} & set(DOMAINS)) if self._offline_default else []
        found["packages"] = package_versions(offline) if offline else {}
        return found

    def describe_calibration(self) -> str:
        """Provenance of calibration-only text (sensitivity, the parallel sweep's C_l)."""
        if self._mixed:
            return f"mixed ({', '.join(DOMAINS)}):train"
        if self.calibration_documents:
            return "user documents"
        return " ".join(self.calibration_files) if self.calibration_files else "austen:calibration"

    def calibration_only_documents(self) -> list[str]:
        """Calibration text for analyses that evaluate nothing (C_l): never the evaluation text."""
        self._refuse_mixed()
        if self.calibration_documents:
            return list(self.calibration_documents)
        return load_documents(self.calibration_files) if self.calibration_files else load_documents(split="calibration")
