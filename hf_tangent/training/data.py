"""Text for evaluation and calibration: the offline Austen corpus, local files, hub datasets.

Calibration and evaluation text are split by document (novel), never by lines, so they cannot
overlap. The Austen novels are read out of Debian's `r-cran-janeaustenr` package the first time
they are needed, and cached as UTF-8 text.
"""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import tempfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..artifacts.checkpoints import cache_dir
from ..ranges import check_ranges

AUSTEN_SPLITS = {
    "calibration": ("prideprejudice", "sensesensibility", "northangerabbey"),
    "evaluation": ("emma", "mansfieldpark"),
}
AUSTEN_NOVELS = AUSTEN_SPLITS["calibration"] + AUSTEN_SPLITS["evaluation"]
# Hub datasets by short name: (path, config, text column). Users with a network only.
HUB_DATASETS = {
    "wikitext-2": ("Salesforce/wikitext", "wikitext-2-raw-v1", "text"),
    "wikitext-103": ("Salesforce/wikitext", "wikitext-103-raw-v1", "text"),
    "openwebtext-10k": ("stas/openwebtext-10k", None, "text"),
}


def _has_novels(folder: Path) -> bool:
    return all((folder / f"{name}.txt").is_file() for name in AUSTEN_NOVELS)


def austen_dir() -> Path:
    """A folder with the Austen novels as <name>.txt: $HF_TANGENT_AUSTEN_DIR, the cache, or Debian."""
    override = os.environ.get("HF_TANGENT_AUSTEN_DIR")
    if override:
        if not _has_novels(Path(override)):
            raise FileNotFoundError(f"HF_TANGENT_AUSTEN_DIR={override} lacks some of {[n + '.txt' for n in AUSTEN_NOVELS]}.")
        return Path(override)
    target = cache_dir() / "austen"
    if not _has_novels(target):
        _extract_austen_from_debian(target)
    return target


def _extract_austen_from_debian(target: Path) -> None:
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise RuntimeError(
            "hf_tangent: the default Austen corpus comes from Debian's r-cran-janeaustenr package, but "
            "apt-get/dpkg-deb are not available here. Put the novels as UTF-8 files "
            f"{', '.join(n + '.txt' for n in AUSTEN_NOVELS)} into a folder and set HF_TANGENT_AUSTEN_DIR, "
            "or pass your own text with --text-files."
        )
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run(["apt-get", "download", "r-cran-janeaustenr"], cwd=tmp, capture_output=True, text=True)
        debs = list(Path(tmp).glob("r-cran-janeaustenr_*.deb"))
        if result.returncode != 0 or not debs:
            raise RuntimeError(
                "hf_tangent: `apt-get download r-cran-janeaustenr` failed (run `apt-get update` first, or set "
                f"HF_TANGENT_AUSTEN_DIR / pass --text-files):\n{result.stderr.strip()}"
            )
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(Path(tmp) / "x")], check=True)
        data = next((Path(tmp) / "x").rglob("janeaustenr/data/Rdata.rdx")).parent
        novels = read_r_lazyload(data / "Rdata")
    staging = Path(tempfile.mkdtemp(dir=_mkdir(target.parent), prefix=".austen-"))
    for name in AUSTEN_NOVELS:
        (staging / f"{name}.txt").write_text("\n".join(str(line) for line in novels[name]), encoding="utf-8")
    staging.chmod(0o755)
    try:
        os.replace(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not _has_novels(target):
            raise


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def read_r_lazyload(stem: Path) -> dict:
    """Objects of an R lazy-load database (stem.rdx index + stem.rdb zlib blobs), via `rdata`."""
    import warnings

    import rdata

    def parse(raw: bytes):
        with warnings.catch_warnings():  # rdata cannot tell a bare serialized object from a file
            warnings.simplefilter("ignore", UserWarning)
            return rdata.conversion.convert(rdata.parser.parse_data(raw))

    index = parse(gzip.decompress(stem.with_suffix(".rdx").read_bytes()))
    blob = stem.with_suffix(".rdb").read_bytes()
    out = {}
    for name, (offset, length) in index["variables"].items():
        chunk = blob[int(offset) : int(offset) + int(length)]
        out[str(name)] = parse(zlib.decompress(chunk[4:]))  # 4-byte length header, then zlib
    return out


def austen_files(split: str = "evaluation") -> list[str]:
    if split not in AUSTEN_SPLITS:
        raise ValueError(f"unknown Austen split {split!r}; accepted: {', '.join(AUSTEN_SPLITS)}.")
    folder = austen_dir()
    return [str(folder / f"{name}.txt") for name in AUSTEN_SPLITS[split]]


def load_documents(text_files: Sequence[str] | None = None, dataset: str | None = None, *,
                   split: str = "evaluation", dataset_split: str = "test", text_column: str | None = None) -> list[str]:
    """Documents (one string each) from local files, a hub dataset, or the Austen default split."""
    import datasets

    if text_files and dataset:
        raise ValueError("pass either text files or a dataset, not both.")
    if dataset:
        path, name, column = HUB_DATASETS.get(dataset, (dataset, None, text_column or "text"))
        try:
            ds = datasets.load_dataset(path, name, split=dataset_split)
        except Exception as err:  # offline, unknown name, or no such split: say which
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


def check_text_files(files: Sequence[str]) -> None:
    """Every file exists and is UTF-8 text; the error names the file (and the byte)."""
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(f"text files not found: {missing}")
    for name in files:
        with open(name, "rb") as f:
            raw = f.read()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"text file {name} is not UTF-8 text (byte {err.start}: {raw[err.start:err.start + 4]!r}); "
                             "convert it, e.g. iconv -f latin1 -t utf-8.") from None


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


@dataclass(frozen=True)
class TextSource:
    """Where evaluation and training text come from, and how reports name it (one place for both).

    Evaluation text: `text_files`, a hub `dataset` (its `dataset_split`), in-memory `documents`, or
    the held-out Austen novels. Training / calibration text: `calibration_files`, in-memory
    `calibration_documents`, the dataset's train split, or the Austen calibration novels; with
    evaluation files only, training uses the first 80% of their documents and evaluation the rest."""

    text_files: tuple[str, ...] | None = None
    dataset: str | None = None
    dataset_split: str = "test"
    calibration_files: tuple[str, ...] | None = None
    documents: tuple[str, ...] | None = None
    calibration_documents: tuple[str, ...] | None = None

    def __post_init__(self):
        check_ranges(self)  # every field's type (ranges.py), as for every options object
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

    @property
    def _own_training(self) -> bool:
        return bool(self.calibration_files or self.calibration_documents)

    def evaluation_documents(self, *, training: bool = False) -> list[str]:
        if self.documents:
            return list(self.documents)
        if self.dataset:
            return load_documents(dataset=self.dataset, dataset_split=self.dataset_split)
        if training and self.text_files and not self._own_training:
            return self._split_files()[0]
        return load_documents(self.text_files, split="evaluation")

    def training_documents(self) -> list[str]:
        """Calibration / training text, never overlapping the evaluation text."""
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

    def describe(self, *, training: bool = False) -> str | dict[str, str]:
        """The provenance written into reports: a string, or {evaluation, calibration} with training."""
        files = " ".join(self.text_files or ())
        split = training and self.text_files and not self._own_training
        evaluation = ("user documents" if self.documents else f"{self.dataset}:{self.dataset_split}" if self.dataset
                      else f"{files} (last 20% of documents)" if split else files or "austen:evaluation")
        if not training:
            return evaluation
        calibration = ("user documents" if self.calibration_documents else " ".join(self.calibration_files)
                       if self.calibration_files else f"{self.dataset}:train" if self.dataset
                       else f"{files} (first 80% of documents)" if split else "austen:calibration")
        return {"evaluation": evaluation, "calibration": calibration}

    def describe_calibration(self) -> str:
        """Provenance of calibration-only text (sensitivity, the parallel sweep's C_l)."""
        if self.calibration_documents:
            return "user documents"
        return " ".join(self.calibration_files) if self.calibration_files else "austen:calibration"

    def calibration_only_documents(self) -> list[str]:
        """Calibration text for analyses that evaluate nothing (C_l): never the evaluation text."""
        if self.calibration_documents:
            return list(self.calibration_documents)
        return load_documents(self.calibration_files) if self.calibration_files else load_documents(split="calibration")
