"""The Austen novels (the corpus hf_tangent always had): read out of Debian's `r-cran-janeaustenr`
package the first time they are needed and cached as UTF-8 text; and the UTF-8 check of text files
that every reader of files uses."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import tempfile
import zlib
from collections.abc import Sequence
from pathlib import Path

from ...artifacts.checkpoints import cache_dir
from ...core.destinations import build_cache
from ..extras import needs_recipes

AUSTEN_SPLITS = {
    "calibration": ("prideprejudice", "sensesensibility", "northangerabbey"),
    "evaluation": ("emma", "mansfieldpark"),
}
AUSTEN_NOVELS = AUSTEN_SPLITS["calibration"] + AUSTEN_SPLITS["evaluation"]
SOURCE_FILE = "source.json"  # {"package", "version"} of the Debian package the novels were read from


def austen_source() -> dict:
    """The package and version the novels were read from, as recorded beside them (None where the folder
    was not extracted by this module: HF_TANGENT_AUSTEN_DIR, or a cache written before it recorded it)."""
    path = austen_dir() / SOURCE_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"package": "r-cran-janeaustenr", "version": None}


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
    version = debs[0].name.split("_")[1]  # name_version_arch.deb: what reports record as the text's source

    def build(staging: Path) -> None:
        for name in AUSTEN_NOVELS:
            (staging / f"{name}.txt").write_text("\n".join(str(line) for line in novels[name]), encoding="utf-8")
        (staging / SOURCE_FILE).write_text(json.dumps({"package": "r-cran-janeaustenr", "version": version}) + "\n",
                                           encoding="utf-8")

    build_cache(target, build, _has_novels)


def read_r_lazyload(stem: Path) -> dict:
    """Objects of an R lazy-load database (stem.rdx index + stem.rdb zlib blobs), via `rdata`."""
    import warnings

    with needs_recipes("reading the Austen novels"):
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
