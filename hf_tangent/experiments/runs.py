"""Run folders, by the HF Trainer's `output_dir` conventions: a recipe writes its entries (report.json,
report.md, plots, patch/, model/, runs/..., the Trainer's checkpoint-N/ and logs) into its output folder,
one run at a time, and leaves every other entry as it is (`hf-tangent eval --output-dir out > out/log`).

- `claim_run_folder`: the check before any work (creates nothing): a symbolic link under a name a run
  writes (never followed) and an input of the run inside the folder are refused by name.
- `RunFolder`: a run's writes, under an exclusive OS file lock (`filelock`, on `.hf_tangent.lock`, the
  only hidden file a run leaves): a second run is refused; a killed run's lock dies with its process.
- A run's own files are replaced atomically: report.json, report.md and plots by `write_atomically`
  (a temporary name, `os.replace`), patch/ and model/ by core/destinations.py's staged write. What a
  kill leaves, the next RunFolder (a temporary file) or write or load (a stage) removes or finishes.

Like the Trainer's output_dir, the folder is not cleared between runs: a rerun replaces the files it
writes; what an earlier run wrote that this one does not (a model/ of other gates, runs/seed1/) stays,
and Trainer checkpoints accumulate (`resume_from_checkpoint`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import threading
import uuid
from pathlib import Path

from filelock import FileLock, Timeout

from ..core.destinations import DestinationError, check_writable, plain_target

LOCK = ".hf_tangent.lock"
_TEMPORARY = re.compile(r"\..+\.hf_tangent-tmp-[0-9a-f]{32}")  # temporary_path's names
# What hf_tangent runs write; hidden: the lock, the mark of earlier releases (never read), and what a killed writer
# left: a temporary file (removed by the next RunFolder), a stage of patch/ or model/ (finished by their next write
# or load). Every other entry is the user's: left as it is.
RUN_ENTRIES = re.compile(r"report\.(json|md)|[^/]+\.png|[^/]+\.safetensors|patch|model|runs|checkpoint-\d+|samples|"
                         rf"lm_eval|README\.md|{re.escape(LOCK)}|\.hf_tangent-run\.json|{_TEMPORARY.pattern}|"
                         r"\.(patch|model)\.hf_tangent-(staging|ready|old|earlier|into|done|kept)-(\d+-)?[0-9a-f]{8}")
FILES = re.compile(rf"report\.(json|md)|[^/]+\.png|README\.md|{re.escape(LOCK)}")  # written as files, one rename each
_CHECKPOINT = re.compile(r"checkpoint-\d+|runs/[^/]+/checkpoint-\d+")  # what a resumed run continues from


def claim_run_folder(folder, *, writer: str = "hf_tangent", inputs: dict | None = None) -> Path:
    """A recipe's output folder (module docstring) and allows writing; `inputs` (what the run reads:
    option -> path or paths) lie outside it (check_inputs). DestinationError otherwise. Creates nothing."""
    text, target = plain_target(folder, writer)
    existing = next(p for p in [target, *target.parents] if p.exists())  # where the run would create it
    if not existing.is_dir():
        raise DestinationError(f"{writer}: {text!r}" + ("" if existing == target else f": {existing}") +
                               " is a file, not a folder; remove it or name another folder.")
    check_writable(text, target, writer)
    check_inputs(target, inputs or {}, writer, text)
    if not target.is_dir():
        return target
    entries = [p for p in target.iterdir() if RUN_ENTRIES.fullmatch(p.name)]  # what a run writes or reads back
    links = sorted(str(p.relative_to(target)) for entry in entries for p in _tree(entry) if p.is_symlink())
    if links:
        raise DestinationError(f"{writer}: {text!r} holds symbolic links ({', '.join(links)}) where a run writes; "
                               "a run writes its own entries and never follows a link. Remove them or name another "
                               "folder.")
    files = sorted(p.name for p in entries if FILES.fullmatch(p.name) and not p.is_symlink() and not p.is_file())
    if files:
        raise DestinationError(f"{writer}: {text!r} holds {', '.join(files)} as something else than a file; a run writes "
                               "a file of that name there. Remove it or name another folder.")
    return target


def _tree(entry: Path):
    """`entry` and, for a folder (never through a link), everything under it."""
    yield entry
    if entry.is_dir() and not entry.is_symlink():
        for root, folders, names in os.walk(entry):
            yield from (Path(root) / name for name in folders + names)


def check_inputs(folder: Path, inputs: dict, writer: str, text: str | None = None) -> None:
    """No input of a run (option -> a path or a list of them; what is not an existing path, a hub id,
    is left out) lies inside its output folder, whose files the run replaces: refused naming both. A
    Trainer checkpoint of the folder (resume_from_checkpoint) is the run's own."""
    target = Path(os.path.realpath(folder))
    for option, values in inputs.items():
        for value in values if isinstance(values, (list, tuple)) else [values]:
            if not isinstance(value, (str, os.PathLike)) or not os.fspath(value) or not os.path.exists(value):
                continue
            path = Path(os.path.realpath(value))
            if path != target and target not in path.parents:
                continue
            if "resume_from_checkpoint" in option and _CHECKPOINT.fullmatch(path.relative_to(target).as_posix()):
                continue
            raise DestinationError(f"{writer}: {option} {os.fspath(value)!r} lies inside the output folder "
                                   f"{text or os.fspath(folder)!r}, whose files this run replaces. Accepted: an input "
                                   "outside the output folder (copy it elsewhere first) or another output folder.")


ACTIVE: dict[Path, int] = {}  # folder -> the thread whose open RunFolder holds it (a nested one is that run's)


class RunFolder:
    """A run's writes into its output folder (module docstring); yields the folder's absolute path.
    `inputs`: what the run reads (check_inputs); resuming from a checkpoint moves nothing in the folder either.
    `active=False` (a rank that does not write the folder) and a RunFolder
    inside another of the same folder and thread (a command's recipe) do nothing."""

    def __init__(self, folder, *, writer: str = "hf_tangent", active: bool = True,
                 inputs: dict | None = None):
        self.folder = Path(os.path.abspath(os.fspath(folder)))
        self.writer, self.inputs, self.active = writer, inputs, active

    def __enter__(self) -> Path:
        self.active = self.active and ACTIVE.get(self.folder) != threading.get_ident()
        if not self.active:
            return self.folder
        claim_run_folder(self.folder, writer=self.writer, inputs=self.inputs)  # before the folder is created
        self.created = next((p for p in [*reversed(self.folder.parents), self.folder] if not p.exists()), None)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.lock = FileLock(self.folder / LOCK, timeout=0)
        try:
            self.lock.acquire()
        except Timeout:
            raise DestinationError(f"{self.writer}: {str(self.folder)!r} is in use by another hf_tangent run (it "
                                   f"holds {LOCK} there); accepted: this folder once that run has ended, or another "
                                   "folder.") from None
        try:
            claim_run_folder(self.folder, writer=self.writer, inputs=self.inputs)  # again, now that no run can write
            for entry in self.folder.iterdir():  # a killed writer's temporary files: no live run writes here now
                if _TEMPORARY.fullmatch(entry.name):
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        except BaseException:
            self.lock.release()
            raise
        ACTIVE[self.folder] = threading.get_ident()
        return self.folder

    def __exit__(self, kind, error, traceback) -> None:
        if not self.active:
            return
        ACTIVE.pop(self.folder, None)
        # A run refused or failed before writing anything leaves no folder it created (the lock file goes while
        # held: filelock retries a lock taken on a removed file).
        empty = kind is not None and self.created is not None and os.listdir(self.folder) == [LOCK]
        if empty:
            (self.folder / LOCK).unlink()
        self.lock.release()
        chain = [self.folder, *self.folder.parents]
        for path in chain[:chain.index(self.created) + 1] if empty else []:
            with contextlib.suppress(OSError):  # not empty any more: another run's now
                path.rmdir()


# The options of the commands that name what a run reads (checked against its --output_dir: check_inputs)
INPUTS = ("model", "model_folders", "include_path", "text_files", "calibration_files", "ablation_report", "reports",
          "resume_from_checkpoint", "deepspeed")


def in_run_folder(command):
    """A command (`command(args)`) run inside a RunFolder of its --output_dir, so that the recipe's
    files and its report are one run of the folder (the rank that writes it: RANK 0); an input of the
    command inside that folder is refused before anything is read."""
    @functools.wraps(command)
    def run(args):
        folder = getattr(args, "output_dir", None)
        if not folder or int(os.environ.get("RANK", "0")) != 0:
            return command(args)
        inputs = {"a report to merge" if name == "reports" else f"--{name}": getattr(args, name)
                  for name in INPUTS if getattr(args, name, None)}
        with RunFolder(folder, writer="--output-dir", inputs=inputs):
            return command(args)

    return run


def temporary_path(path: Path) -> Path:
    """A hidden name beside `path` for writing it (the folder's next RunFolder removes one a kill left)."""
    return path.with_name(f".{path.name}.hf_tangent-tmp-{uuid.uuid4().hex}")


def write_atomically(path: Path, data: str | bytes) -> None:
    """`path` gets `data` in one rename: a kill leaves the old file or the new one (and maybe a temporary
    file, removed by the folder's next RunFolder); an error leaves the old file and no temporary one."""
    temporary = temporary_path(path)
    try:
        temporary.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
