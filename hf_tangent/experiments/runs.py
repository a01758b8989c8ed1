"""Run folders: a recipe's output folder (report.json, report.md, plots, Trainer checkpoints, patch
repos and complete folders, per-run folders) holds one run, the latest, and nothing a report of it
does not describe.

- `claim_run_folder(folder)`: the check before any work (a new or empty folder, or an earlier
  hf_tangent run's folder, which allows writing; DestinationError otherwise), with `inputs=`: no
  input of the run inside it. Creates nothing. An earlier run's folder is known by its mark, the
  file `.hf_tangent-run.json` every run leaves in it (or, from releases before the mark, a
  report.json of an hf_tangent command): a folder of files that merely have a run's names
  (`model/`, `README.md`, `runs/`) is not one.
- `RunFolder(folder)`: a run's writes. On entry it marks the folder as held by this process (a
  second run into a folder a live process holds is refused), and everything an earlier run left is
  moved into a hidden folder inside it; on a clean exit that folder is removed, so the folder holds
  this run's files only (a rerun without `--save_full_model` leaves no `model/` of the earlier run, a
  rerun with fewer seeds no `runs/seed1/`). On an error the earlier run is moved back and what this
  run wrote is removed, unless this run left a complete Trainer checkpoint: then it stays for
  `--resume_from_checkpoint`, the earlier run kept aside until the folder's next run (or
  `recover_run_folder(folder)`, which gives it back). A run resumed from one of the folder's own
  checkpoints (`resume="last"` or a checkpoint inside it) keeps the folder's Trainer checkpoints
  where they are; resumed from a checkpoint elsewhere, they go like any earlier run's files.
- `Report.save` writes a report into a run folder: inside the run's own RunFolder when the recipe
  made one, else in one of its own; each file through a temporary name, report.json last.

Each step is one rename or removal, and the hidden folder's name says which phase it is in, so a
kill at any point is finished or rolled back by the folder's next claim (`recover_run_folder`,
with a log line): an interrupted claim is moved back; an interrupted run (killed, or stopped with a
checkpoint) is removed and the earlier run moved back, or, resumed, continued; a commit is finished.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import socket
import uuid
from pathlib import Path

from ..core.destinations import DestinationError, check_writable, leftovers, plain_target, recover

logger = logging.getLogger("hf_tangent")

# What hf_tangent runs write into their output folder: reports, plots, the directions file, patch
# repos and complete folders, Trainer checkpoints and logs, per-run folders; and, hidden, the run
# folder's mark, a writer's stage of one of them (.patch.hf_tangent-staging-...), a run's earlier run
# and a file being written.
MARK = ".hf_tangent-run.json"
RUN_ENTRIES = re.compile(r"report\.(json|md)|[^/]+\.png|[^/]+\.safetensors|patch|model|runs|checkpoint-\d+|"
                         r"samples|lm_eval|README\.md|\..+\.hf_tangent-(staging|ready|old|tmp)-\d+-[0-9a-f]{8}|"
                         r"\.hf_tangent-run-(moving|earlier|rollback|discard)-\d+-[0-9a-f]{8}|" + re.escape(MARK))
_HIDDEN = re.compile(r"\.hf_tangent-run-(?P<phase>moving|earlier|rollback|discard)-(?P<pid>\d+)-[0-9a-f]{8}")
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.hf_tangent-tmp-(?P<pid>\d+)-[0-9a-f]{8}")
_CHECKPOINT = re.compile(r"checkpoint-\d+|runs/[^/]+/checkpoint-\d+")  # what a resumed run continues from


def claim_run_folder(folder, *, writer: str = "hf_tangent", inputs: dict | None = None) -> Path:
    """A recipe's output folder is a new or empty folder, or an earlier hf_tangent run's (marked, module
    docstring), which the run replaces, and allows writing; `inputs` (what the run reads: option ->
    path or paths) lie outside it (check_inputs). Refused like a destination (DestinationError)
    otherwise. Creates nothing."""
    text, target = plain_target(folder, writer)
    existing = next(p for p in [target, *target.parents] if p.exists())  # where the run would create it
    if not existing.is_dir():
        raise DestinationError(f"{writer}: {text!r}" + ("" if existing == target else f": {existing}") +
                               " is a file, not a folder; remove it or name another folder.")
    check_writable(text, target, writer)
    check_inputs(target, inputs or {}, writer, text)
    if not target.is_dir():
        return target
    names = sorted(p.name for p in target.iterdir())
    others = [name for name in names if not RUN_ENTRIES.fullmatch(name)]
    if others:
        raise DestinationError(f"{writer}: {text!r} holds files no hf_tangent run writes "
                               f"({', '.join(others[:5])}{' ...' if len(others) > 5 else ''}); the run would write "
                               "report.json, report.md, plots and checkpoints beside them. Name a new or empty folder.")
    shown = [name for name in names if not name.startswith(".")]
    if shown and MARK not in names and not _report_of_a_run(target):
        raise DestinationError(f"{writer}: {text!r} holds {', '.join(shown[:5])}{' ...' if len(shown) > 5 else ''}, "
                               f"but is not an hf_tangent run's folder (no {MARK}, the mark every run leaves, nor a "
                               "report.json of an hf_tangent command); the run would replace them. Accepted: a new or "
                               "empty folder, or an earlier hf_tangent run's folder; move the files or name another "
                               "folder.")
    return target


KINDS: set[str] = set()  # the kinds of report hf_tangent writes (report.register_report adds each)


def _report_of_a_run(folder: Path) -> bool:
    """`folder` holds the report.json of an hf_tangent command (a run folder of a release before the mark)."""
    try:
        data = json.loads((folder / "report.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    kind = data.get("command") or ("study" if "study" in data else None) if isinstance(data, dict) else None
    return isinstance(kind, str) and kind in KINDS


def check_inputs(folder: Path, inputs: dict, writer: str, text: str | None = None) -> None:
    """No input of a run (option -> a path or a list of them; what is not an existing path, a hub id,
    is left out) lies inside its output folder, whose earlier run the run moves aside before it reads
    anything: refused naming both. A Trainer checkpoint of the folder (resume_from_checkpoint) is the
    run's own."""
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
                                   f"{text or os.fspath(folder)!r}, whose earlier run this run replaces (moved aside "
                                   "before anything is read). Accepted: an input outside the output folder (copy it "
                                   "elsewhere first) or another output folder.")


def _mark(folder: Path, pid: int | None) -> None:
    """The run folder's mark: held by process `pid` of this host, or by none (None: the run ended)."""
    write_atomically(folder / MARK, json.dumps({"hf_tangent": "run folder", "pid": pid,
                                                "host": socket.gethostname() if pid else None}) + "\n")


def _holder(folder: Path) -> int | None:
    """The live process of this host, other than this one, that the folder's mark says holds it."""
    try:
        mark = json.loads((folder / MARK).read_text(encoding="utf-8"))
        pid = int(mark["pid"]) if mark["pid"] is not None and mark["host"] == socket.gethostname() else None
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError):
        return None
    if pid is None or pid == os.getpid():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except OSError:
        return pid  # alive, another user's
    return pid


def _hidden(folder: Path, phase: str) -> Path:
    return folder / f".hf_tangent-run-{phase}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _visible(folder: Path) -> list[Path]:
    """The entries of a run (not the mark, not a run's hidden folders)."""
    return sorted(p for p in folder.iterdir() if not p.name.startswith(".hf_tangent-run"))


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
    step logged, and every interrupted artifact write in it (destinations.recover): the earlier run's
    files, kept aside by a run that stopped, are back (and the stopped run's checkpoints gone). A
    folder a live process holds is left alone (its run is not over). Returns the hidden folder of an
    interrupted run's earlier run that a resumed run takes over (resume=True), else None."""
    folder = Path(os.path.abspath(os.fspath(folder)))
    if not folder.is_dir():
        return None
    holder = _holder(folder)
    if holder is not None:
        logger.warning("%s: %s: another run, pid %s, is writing into it; nothing recovered.", writer, folder, holder)
        return None
    taken = None
    for entry in sorted(folder.iterdir()):
        if not os.path.lexists(entry):  # removed by an earlier step of this loop (a roll-back)
            continue
        hidden = _HIDDEN.fullmatch(entry.name)
        if _TEMPORARY.fullmatch(entry.name):
            _remove(entry)
            logger.warning("%s: removed %s, a file an interrupted run of %s was writing.", writer, entry.name, folder)
        if hidden is None:
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
    if (folder / MARK).is_file() and b'"pid": null' not in (folder / MARK).read_bytes():
        _mark(folder, None)  # the run that held it is over
    return taken


def _has_checkpoint(folder: Path) -> bool:
    return any((p / "trainer_state.json").is_file() for p in [*folder.glob("checkpoint-*"),
                                                                 *folder.glob("runs/*/checkpoint-*")]
               if _CHECKPOINT.fullmatch(p.relative_to(folder).as_posix()))


ACTIVE: set[Path] = set()  # the folders an open RunFolder of this process holds (a nested one is that run's)


class RunFolder:
    """The writes of one run into its output folder (module docstring), as a context manager that
    yields the folder's absolute path. `resume`: the run's resume_from_checkpoint (continues); `inputs`:
    what it reads (check_inputs). `active=False` (the ranks of a distributed run that do not write the
    run folder), and a RunFolder inside another of the same folder (a recipe run by a command, which
    holds the folder for the recipe and its report), do nothing."""

    def __init__(self, folder, *, writer: str = "hf_tangent", resume=False, active: bool = True,
                 inputs: dict | None = None):
        self.folder = Path(os.path.abspath(os.fspath(folder)))
        self.writer, self.resume, self.inputs = writer, continues(self.folder, resume), inputs
        self.active = active and self.folder not in ACTIVE
        self.earlier: Path | None = None

    def __enter__(self) -> Path:
        if not self.active:
            return self.folder
        claim_run_folder(self.folder, writer=self.writer, inputs=self.inputs)
        holder = _holder(self.folder)
        if holder is not None:
            raise DestinationError(f"{self.writer}: {self.folder}: another run, pid {holder}, is writing into it; "
                                   "accepted: this folder once that run has ended, or another folder.")
        ACTIVE.add(self.folder)
        try:
            self._claim()
        except BaseException:
            ACTIVE.discard(self.folder)
            raise
        return self.folder

    def _claim(self) -> None:
        self.created = next((p for p in [*reversed(self.folder.parents), self.folder] if not p.exists()), None)
        self.earlier = recover_run_folder(self.folder, writer=self.writer, resume=self.resume)
        self.marked = (self.folder / MARK).is_file()
        if self.created is not None:
            self.folder.mkdir(parents=True)
        _mark(self.folder, os.getpid())  # held: a second run is refused, and recovers nothing of this one
        if self.earlier is not None:  # an interrupted run resumed: its checkpoints stay, the rest of it goes
            _move_aside(self.folder, None, _resumed)
            self.earlier = self._own(self.earlier, "earlier")
        elif _visible(self.folder):
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
        if not self.folder.is_dir():
            return
        if kind is None:
            if self.earlier is not None:
                discard = self._own(self.earlier, "discard")
                shutil.rmtree(discard, ignore_errors=True)  # what is left, the folder's next claim removes
            _mark(self.folder, None)
            return
        if _has_checkpoint(self.folder):
            _mark(self.folder, None)
            logger.warning("%s: the run in %s stopped (%s); its Trainer checkpoints stay there "
                           "(--resume_from_checkpoint last continues it)%s.", self.writer, self.folder, kind.__name__,
                           "" if self.earlier is None else
                           f", and the earlier run's files in {self.earlier.name} until the folder's next run (to get "
                           "them back now, dropping the checkpoints: python -c \"from hf_tangent.experiments.runs "
                           f"import recover_run_folder; recover_run_folder({str(self.folder)!r})\")")
            return
        if self.earlier is not None:
            _roll_back(self.folder, self.earlier, self.writer, f"the run stopped ({kind.__name__}) and was rolled back")
        else:
            for entry in _visible(self.folder):
                _remove(entry)
        if self.marked:
            _mark(self.folder, None)
        else:
            (self.folder / MARK).unlink(missing_ok=True)
        for path in [self.folder, *self.folder.parents] if self.created is not None else []:
            if any(path.iterdir()):  # the folders the claim made, removed again where nothing else is in them
                break
            path.rmdir()
            if path == self.created:
                break


def continues(folder, checkpoint) -> bool:
    """A run resumed from `checkpoint` (a resume_from_checkpoint value) continues the run of `folder`:
    True, "last", or one of the folder's own checkpoints. Resumed from a checkpoint elsewhere (or not
    resumed), it replaces the folder's earlier run, checkpoints included."""
    if checkpoint is True or checkpoint in ("last", "true", "True"):
        return True
    if not isinstance(checkpoint, (str, os.PathLike)) or not os.fspath(checkpoint):
        return False
    return Path(os.path.realpath(folder)) in Path(os.path.realpath(checkpoint)).parents


# The options of the commands that name what a run reads (checked against its --output_dir: check_inputs)
INPUTS = ("model", "model_folders", "include_path", "text_files", "calibration_files", "ablation_report", "reports",
          "resume_from_checkpoint", "deepspeed")


def in_run_folder(command):
    """A command (`command(args)`) run inside a RunFolder of its --output_dir, so that the recipe's
    files and its report are one run of the folder (the rank that writes it: RANK 0); an input of the
    command inside that folder is refused before anything moves."""
    @functools.wraps(command)
    def run(args):
        folder = getattr(args, "output_dir", None)
        if not folder or int(os.environ.get("RANK", "0")) != 0:
            return command(args)
        inputs = {"a report to merge" if name == "reports" else f"--{name}": getattr(args, name)
                  for name in INPUTS if getattr(args, name, None)}
        with RunFolder(folder, writer="--output-dir", resume=getattr(args, "resume_from_checkpoint", None),
                       inputs=inputs):
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
