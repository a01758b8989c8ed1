"""Run folders: a recipe's output folder (report.json, report.md, plots, Trainer checkpoints, patch
repos and complete folders, per-run folders) holds one run, the latest, and nothing a report of it
does not describe.

- `claim_run_folder(folder)`: the check before any work (a new or empty folder, or one that holds
  only what hf_tangent runs write and allows writing; DestinationError otherwise). Creates nothing.
- `RunFolder(folder)`: a run's writes. On entry, everything an earlier run left is moved into a
  hidden folder inside it; on a clean exit that folder is removed, so the folder holds this run's
  files only (a rerun without `--save_full_model` leaves no `model/` of the earlier run, a rerun
  with fewer seeds no `runs/seed1/`). On an error the earlier run is moved back and what this run
  wrote is removed, unless this run left a complete Trainer checkpoint: then it stays for
  `--resume_from_checkpoint`, the earlier run kept aside until the folder's next run. With
  `resume=True` the Trainer checkpoints in the folder stay where they are for the run to continue.
- `Report.save` writes a report into a run folder: inside the run's own RunFolder when the recipe
  made one, else in one of its own; each file through a temporary name, report.json last.

Each step is one rename or removal, and the hidden folder's name says which phase it is in, so a
kill at any point is finished or rolled back by the folder's next claim (`recover_run_folder`,
with a log line): an interrupted claim is moved back; an interrupted run (killed, or stopped with a
checkpoint) is removed and the earlier run moved back, or, resumed, continued; a commit is finished.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import uuid
from pathlib import Path

from ..core.destinations import DestinationError, check_writable, leftovers, plain_target, recover

logger = logging.getLogger("hf_tangent")

# What hf_tangent runs write into their output folder: reports, plots, the directions file, patch
# repos and complete folders, Trainer checkpoints and logs, per-run folders; and, hidden, a writer's
# stage of one of them (.patch.hf_tangent-staging-...), a run's earlier run and a file being written.
RUN_ENTRIES = re.compile(r"report\.(json|md)|[^/]+\.png|[^/]+\.safetensors|patch|model|runs|checkpoint-\d+|"
                         r"samples|lm_eval|README\.md|\..+\.hf_tangent-(staging|ready|old|tmp)-\d+-[0-9a-f]{8}|"
                         r"\.hf_tangent-run-(moving|earlier|rollback|discard)-\d+-[0-9a-f]{8}")
_HIDDEN = re.compile(r"\.hf_tangent-run-(?P<phase>moving|earlier|rollback|discard)-(?P<pid>\d+)-[0-9a-f]{8}")
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.hf_tangent-tmp-(?P<pid>\d+)-[0-9a-f]{8}")
_CHECKPOINT = re.compile(r"checkpoint-\d+|runs/[^/]+/checkpoint-\d+")  # what a resumed run continues from


def claim_run_folder(folder, *, writer: str = "hf_tangent") -> Path:
    """A recipe's output folder is a new or empty folder, or one that holds only what hf_tangent runs
    write (an earlier run, which the run replaces), and allows writing: refused like a destination
    (DestinationError) otherwise. Creates nothing."""
    text, target = plain_target(folder, writer)
    if target.exists() and not target.is_dir():
        raise DestinationError(f"{writer}: {text!r} is a file, not a folder; remove it or name another folder.")
    check_writable(text, target, writer)
    if not target.is_dir():
        return target
    others = sorted(p.name for p in target.iterdir() if not RUN_ENTRIES.fullmatch(p.name))
    if others:
        raise DestinationError(f"{writer}: {text!r} holds files no hf_tangent run writes "
                               f"({', '.join(others[:5])}{' ...' if len(others) > 5 else ''}); the run would write "
                               "report.json, report.md, plots and checkpoints beside them. Name a new or empty folder.")
    return target


def _hidden(folder: Path, phase: str) -> Path:
    return folder / f".hf_tangent-run-{phase}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _dead(pid: str) -> bool:
    """The process that named a hidden entry is gone (or is this one: a run it left behind)."""
    if int(pid) == os.getpid():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _visible(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if not p.name.startswith(".hf_tangent-run-"))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _resumed(name: str) -> str:
    """What a resumed run's claim does with an entry (relative path): "keep" a Trainer checkpoint,
    "split" a folder that holds some, "move" the rest aside."""
    if _CHECKPOINT.fullmatch(name):
        return "keep"
    return "split" if re.fullmatch(r"runs(/[^/]+)?", name) else "move"


def _move_aside(folder: Path, aside: Path | None, plan, rel: str = "") -> None:
    """Move every entry of `folder` (below `rel`) into the same place under `aside` (None: remove it),
    as `plan` says."""
    for entry in _visible(folder / rel):
        name = f"{rel}/{entry.name}" if rel else entry.name
        action = plan(name) if entry.is_dir() and not entry.is_symlink() else "move"
        if action == "keep":
            continue
        if action == "split":
            _move_aside(folder, aside, plan, name)
            continue
        if aside is None:
            _remove(entry)
            continue
        (aside / name).parent.mkdir(parents=True, exist_ok=True)
        os.replace(entry, aside / name)


def _move_back(aside: Path, folder: Path, rel: str = "") -> None:
    """Every entry of `aside` back to its place in `folder` (merging into folders that stayed)."""
    for entry in sorted((aside / rel).iterdir()):
        name = f"{rel}/{entry.name}" if rel else entry.name
        place = folder / name
        if entry.is_dir() and not entry.is_symlink() and place.is_dir() and not place.is_symlink():
            _move_back(aside, folder, name)
            continue
        place.parent.mkdir(parents=True, exist_ok=True)
        os.replace(entry, place)
    shutil.rmtree(aside / rel)


def _roll_back(folder: Path, earlier: Path, writer: str, why: str) -> None:
    """Remove what the run in `folder` wrote and move the earlier run (`earlier`) back."""
    doomed = earlier.with_name(_hidden(folder, "rollback").name)
    os.replace(earlier, doomed)
    _finish_rollback(folder, doomed)
    logger.warning("%s: %s: %s; the earlier run's files are back.", writer, folder, why)


def _finish_rollback(folder: Path, doomed: Path) -> None:
    for entry in _visible(folder):
        _remove(entry)
    moving = doomed.with_name(_hidden(folder, "moving").name)
    os.replace(doomed, moving)
    _move_back(moving, folder)


def recover_run_folder(folder, *, writer: str = "hf_tangent", resume: bool = False) -> Path | None:
    """Finish or roll back what a killed or stopped run of `folder` left (module docstring), each
    step logged, and every interrupted artifact write in it (destinations.recover). Returns the
    hidden folder of an interrupted run's earlier run that a resumed run takes over (resume=True),
    else None."""
    folder = Path(os.path.abspath(os.fspath(folder)))
    if not folder.is_dir():
        return None
    taken = None
    for entry in sorted(folder.iterdir()):
        if not os.path.lexists(entry):  # removed by an earlier step of this loop (a roll-back)
            continue
        hidden, temporary = _HIDDEN.fullmatch(entry.name), _TEMPORARY.fullmatch(entry.name)
        if temporary and _dead(temporary["pid"]):
            _remove(entry)
            logger.warning("%s: removed %s, a file an interrupted run of %s was writing.", writer, entry.name, folder)
        if hidden is None or not _dead(hidden["pid"]):
            continue
        phase = hidden["phase"]
        if phase == "discard":
            shutil.rmtree(entry)
            logger.warning("%s: %s: finished removing an earlier run that a completed run replaced.", writer, folder)
        elif phase == "moving":
            _move_back(entry, folder)
            logger.warning("%s: %s: an interrupted claim was rolled back (the earlier run's files are back).", writer,
                           folder)
        elif phase == "rollback":
            _finish_rollback(folder, entry)
            logger.warning("%s: %s: an interrupted roll-back was finished (the earlier run's files are back).", writer,
                           folder)
        elif resume and taken is None:
            taken = entry  # the interrupted run continues: its earlier run stays aside
        else:
            _roll_back(folder, entry, writer, "a run that did not finish (killed or stopped) was rolled back")
    for name in {m["name"] for m in (re.fullmatch(r"\.(?P<name>.+)\.hf_tangent-(staging|ready|old)-\d+-[0-9a-f]{8}",
                                                  p.name) for p in folder.iterdir()) if m}:
        if any(leftovers(folder / name).values()):
            recover(folder / name, writer=writer)
    return taken


def _has_checkpoint(folder: Path) -> bool:
    return any((p / "trainer_state.json").is_file() for p in [*folder.glob("checkpoint-*"),
                                                                 *folder.glob("runs/*/checkpoint-*")]
               if _CHECKPOINT.fullmatch(p.relative_to(folder).as_posix()))


ACTIVE: set[Path] = set()  # the folders an open RunFolder of this process holds (a nested one is that run's)


class RunFolder:
    """The writes of one run into its output folder (module docstring), as a context manager that
    yields the folder's absolute path. `active=False` (the ranks of a distributed run that do not
    write the run folder), and a RunFolder inside another of the same folder (a recipe run by a
    command, which holds the folder for the recipe and its report), do nothing."""

    def __init__(self, folder, *, writer: str = "hf_tangent", resume: bool = False, active: bool = True):
        self.folder = Path(os.path.abspath(os.fspath(folder)))
        self.writer, self.resume = writer, resume
        self.active = active and self.folder not in ACTIVE
        self.earlier: Path | None = None

    def __enter__(self) -> Path:
        if not self.active:
            return self.folder
        claim_run_folder(self.folder, writer=self.writer)
        ACTIVE.add(self.folder)
        try:
            self._claim()
        except BaseException:
            ACTIVE.discard(self.folder)
            raise
        return self.folder

    def _claim(self) -> None:
        self.existed = self.folder.exists()
        self.earlier = recover_run_folder(self.folder, writer=self.writer, resume=self.resume)
        if self.earlier is not None:  # an interrupted run resumed: its checkpoints stay, the rest of it goes
            _move_aside(self.folder, None, _resumed)
            self.earlier = self._own(self.earlier, "earlier")
        elif self.folder.is_dir() and _visible(self.folder):
            moving = _hidden(self.folder, "moving")
            moving.mkdir()
            _move_aside(self.folder, moving, _resumed if self.resume else (lambda name: "move"))
            self.earlier = self._own(moving, "earlier")

    def _own(self, hidden: Path, phase: str) -> Path:
        owned = _hidden(self.folder, phase)
        os.replace(hidden, owned)
        return owned

    def __exit__(self, kind, error, traceback) -> None:
        if not self.active:
            return
        ACTIVE.discard(self.folder)
        if kind is None:
            if self.earlier is not None:
                discard = self._own(self.earlier, "discard")
                shutil.rmtree(discard, ignore_errors=True)  # what is left, the folder's next claim removes
            return
        if _has_checkpoint(self.folder):
            logger.warning("%s: the run in %s stopped (%s); its Trainer checkpoints stay there "
                           "(--resume_from_checkpoint last continues it)%s.", self.writer, self.folder, kind.__name__,
                           "" if self.earlier is None else
                           f", and the earlier run's files in {self.earlier.name} until the folder's next run")
            return
        if self.earlier is not None:
            _roll_back(self.folder, self.earlier, self.writer, f"the run stopped ({kind.__name__}) and was rolled back")
        elif self.folder.is_dir():
            for entry in _visible(self.folder):
                _remove(entry)
            if not self.existed and not any(self.folder.iterdir()):
                self.folder.rmdir()


def in_run_folder(command):
    """A command (`command(args)`) run inside a RunFolder of its --output_dir, so that the recipe's
    files and its report are one run of the folder (the rank that writes it: RANK 0)."""
    @functools.wraps(command)
    def run(args):
        folder = getattr(args, "output_dir", None)
        if not folder or int(os.environ.get("RANK", "0")) != 0:
            return command(args)
        with RunFolder(folder, writer="--output-dir", resume=bool(getattr(args, "resume_from_checkpoint", None))):
            return command(args)

    return run


def temporary_path(path: Path) -> Path:
    """A hidden name beside `path` for writing it (the folder's next claim removes one a kill left)."""
    return path.with_name(f".{path.name}.hf_tangent-tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def write_atomically(path: Path, data: str | bytes) -> None:
    """`path` gets `data` in one rename: a kill leaves the old file or the new one (and a temporary
    file that the folder's next claim removes)."""
    temporary = temporary_path(path)
    try:
        if isinstance(data, str):
            temporary.write_text(data, encoding="utf-8")
        else:
            temporary.write_bytes(data)
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()
