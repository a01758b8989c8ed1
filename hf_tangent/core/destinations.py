"""Where hf_tangent may write a folder, and how it replaces one.

A writer (a patch repo, a complete patched folder, an export) writes into a new or empty folder,
or replaces an artifact that hf_tangent wrote there before, whole; nothing else. Refused, with
the folder left byte-identical: `""`, `~`, the current folder and every folder above it, the home
folder, a symlink, a mount point, a file in the way, a folder that does not allow writing, a
protected folder (the model's own base, the source being read), a folder that holds one or lies
inside one, and a non-empty folder that is not an hf_tangent artifact or holds entries an
hf_tangent artifact never has (a user's files are never deleted), except a Trainer's output_dir.

Every write is staged next to the target and is crash-consistent: after a kill at any point the
target is its old content or the new one, complete. The steps, each one filesystem call:

    .NAME.hf_tangent-staging-ID   created, then written (a kill leaves an incomplete stage)
    .NAME.hf_tangent-ready-ID     the stage renamed once complete
    .NAME.hf_tangent-old-ID       the old folder renamed aside (when it holds anything)
    NAME                          the ready stage renamed in (over an empty folder: one rename)
                                  then the old folder removed

The writer holds an exclusive `flock` on each folder it stages or moves aside: the lock is on the folder
itself, so it follows it through the renames, and it ends with the writer's process; a stage is made and
locked under the parent's lock, which `recover` holds while it looks. So a leftover is abandoned exactly
when its lock can be taken; nothing but the target it belongs to is read from a name.
The next writer or loader of NAME (`recover`) finishes what a killed process left: a ready stage with no
NAME is moved in, an old folder with no NAME is moved back, and every other abandoned leftover
(incomplete stages, ready stages that lost, old folders replaced) is removed; each with a log line. Only
folders named as above are touched: any other folder beside NAME may be a user's. An artifact is replaced
whole: no file of the earlier save survives (old shards, an old index, a record of the other kind, the
tokenizer or card saved with it); each dropped file that is not part of an artifact (a tokenizer, a card,
Trainer state: maybe written by someone else) is named in a log line.

A Trainer's `output_dir` is written into, not replaced: a folder holding an entry that only the
Trainer and TRL put there (`checkpoint-N/`, `runs/`, `completions/`, `<split>_results.json`), beside
nothing but an artifact of ours and the files other writers put beside a model (the Trainer's card,
state and arguments, a tokenizer). Those stay as they are (but for a file of the same name that the
save writes: a card, a tokenizer). The same stages, entry by entry:

    .NAME.hf_tangent-ready-ID     the complete stage
    .NAME.hf_tangent-earlier-ID   the earlier save's entries moved into it, its record first
    .NAME.hf_tangent-into-ID      the stage renamed: every entry of the earlier save is aside
    NAME/...                      each staged entry moved in (a file of the same name aside first), the
                                  record last
    .NAME.hf_tangent-done-ID      the aside folder renamed (the save is final), then removed, and -into-

`recover` rolls an abandoned `-earlier-` back (its entries move back) unless its `-into-` exists, which
it finishes (the rest of its entries move in): a folder without a record in between, never a mix.
Every name is made from NAME and the stage's ID (never by editing another name). Once its stage is
written, a writer takes the parent folder's flock and then the target's (waiting), settles what a save
killed meanwhile left, lets the parent's go, and holds the target's to the end: saves of one folder move
in one after the other, the last one's is the folder. `recover` takes the parent's (one recovery at a
time, so two never split one save's leftovers). A folder this thread holds already is not waited for (flock locks an open file
description, so a second lock would wait for the thread itself).

Not shipped as remote code: a model loaded through a folder's remote code saves the way transformers saves.
"""

from __future__ import annotations

import contextlib
import fcntl
import filecmp
import inspect
import json
import logging
import os
import re
import shutil
import threading
import warnings
from pathlib import Path

from .registry import CONFIG_KEY

PATCH_RECORD_FILE = "hf_tangent_patch.json"  # the record of a patch repo of formats 1-2 (artifacts/patch_repo.py)
ADAPTER_RECORD_FILE = "adapter_config.json"  # format 3's: a PEFT adapter folder, peft_type ADAPTER_PEFT_TYPE
ADAPTER_PEFT_TYPE = "HF_TANGENT"
GATES_FILE = "gates.safetensors"  # a patch repo's gates (formats 1-2)
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # format 3's gates (and a LoRA subfolder's weights)
# What a patched folder carries as remote code: the core modules a patched forward needs (it patches from the saved
# spec: no discovery, no write safety, no Triton kernel, no reference rules) and the two files hub.py generates.
REMOTE_GENERATED_FILES = ("configuration_hf_tangent.py", "modeling_hf_tangent.py")
SHIPPED_CORE_MODULES = ("_version.py", "checks.py", "config.py", "fused.py", "install.py", "layer.py", "noise.py",
                        "registry.py", "remote.py", "wrappers.py")
REMOTE_CODE_MODULES = (*SHIPPED_CORE_MODULES, *REMOTE_GENERATED_FILES)
_EARLIER_REMOTE_CODE = ("calls.py", "destinations.py", "discovery.py", "fused_parallel.py", "options.py", "patching.py",
                        "rules.py", "triton_update.py")  # earlier saves shipped these too
logger = logging.getLogger("hf_tangent")

# What an hf_tangent artifact (a patch repo, or a complete patched folder) is made of: replaced whole.
_ARTIFACT_FILES = {PATCH_RECORD_FILE, GATES_FILE, ADAPTER_RECORD_FILE, ADAPTER_WEIGHTS,
                   "config.json", "generation_config.json",
                   "model.safetensors", "model.safetensors.index.json", ".gitattributes", *REMOTE_CODE_MODULES,
                   *_EARLIER_REMOTE_CODE}
_ARTIFACT_FOLDERS = {"adapter": {ADAPTER_RECORD_FILE, ADAPTER_WEIGHTS, "README.md"},
                     "__pycache__": None}  # None: any *.pyc
_SHARD = re.compile(r"model-\d+-of-\d+\.safetensors")
# What other writers put beside a model by convention (tokenizer.save_pretrained, a model card, the
# Trainer's state in a checkpoint folder). In a folder that holds only these (written before the
# model's first save: the Trainer writes its state after the model) they are carried into the save;
# in an artifact they belong to the earlier save and go with it.
_TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                    "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json"}
_NEIGHBOURS = {*_TOKENIZER_FILES, "README.md", "optimizer.pt", "scheduler.pt", "scaler.pt", "trainer_state.json",
               "training_args.bin"}
_RNG_STATE = re.compile(r"rng_state(_\d+)?\.pth")
# What only an output_dir holds (Trainer._save_checkpoint, the tensorboard logging_dir, save_metrics; TRL's
# completions): such a folder is written into, never replaced (module docstring).
_OUTPUT_DIR_FOLDERS = re.compile(r"checkpoint-\d+|runs|completions")
_OUTPUT_DIR_FILES = re.compile(r"\w+_results\.json")
_RECORDS = ("config.json", PATCH_RECORD_FILE, ADAPTER_RECORD_FILE)  # what makes a folder load as an artifact
MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
# A stage, a ready stage or an old copy of NAME (module docstring). Only these names are touched: the older
# .NAME.old-ID and .NAME.staging-ID cannot be told apart from a user's folder (.NAME.old-20240115), so they are
# left alone; earlier saves put a process id before the ID (matched, never read).
_LEFTOVER = re.compile(r"\.(?P<name>.+)\.hf_tangent-(?P<state>staging|ready|old|earlier|into|done)-(?:\d+-)?"
                       r"(?P<id>[0-9a-f]{8})")


class DestinationError(ValueError):
    """A folder hf_tangent refuses to write to; the message names it and what is accepted."""


def artifact_kind(folder: str | os.PathLike) -> str | None:
    """"patch repo" or "patched folder" when `folder` is an artifact hf_tangent wrote (known by its
    record: a mapping with the patch's config under config.json's CONFIG_KEY, or a patch repo's record
    file), else None: what a writer may replace. A patch record beside a model that is not a patched one
    is not ours. (The loaders read records for what to load: serialization.saved_record, is_patch_repo.)"""
    folder = Path(folder)
    try:
        with open(folder / "config.json", encoding="utf-8") as f:
            data = json.load(f)
        record = data.get(CONFIG_KEY) if isinstance(data, dict) else None
        patched = isinstance(record, dict) and isinstance(record.get("config"), dict)  # a record holds its config
    except (OSError, ValueError):
        patched = False
    if patched:
        return "patched folder"
    if any((folder / name).exists() for name in MODEL_FILES):
        return None
    if (folder / PATCH_RECORD_FILE).is_file():
        return "patch repo"
    try:
        with open(folder / ADAPTER_RECORD_FILE, encoding="utf-8") as f:
            data = json.load(f)
        return "patch repo" if isinstance(data, dict) and data.get("peft_type") == ADAPTER_PEFT_TYPE else None
    except (OSError, ValueError):
        return None


def _is_neighbour(name: str) -> bool:
    return name in _NEIGHBOURS or bool(_RNG_STATE.fullmatch(name))


def _output_dir_entry(entry: Path) -> bool:
    return bool(_OUTPUT_DIR_FOLDERS.fullmatch(entry.name) and entry.is_dir()
                or _OUTPUT_DIR_FILES.fullmatch(entry.name) and entry.is_file())


def foreign_entries(folder: Path, kind: str | None) -> list[str]:
    """The entries of `folder` that are neither part of an hf_tangent artifact (when it is one:
    `kind`) nor files other writers put beside a model nor a Trainer output_dir's: what a save would delete."""
    foreign = []
    for entry in sorted(folder.iterdir()):
        if _is_neighbour(entry.name) and entry.is_file() or _output_dir_entry(entry):
            continue
        if _LEFTOVER.fullmatch(entry.name) and entry.is_dir() and not entry.is_symlink():
            continue  # a stage of a save of something inside (a checkpoint): that save's recover() settles it
        if kind is not None and entry.is_file() and not entry.is_symlink() and (
                entry.name in _ARTIFACT_FILES or _SHARD.fullmatch(entry.name)):
            continue
        if kind is not None and entry.name in _ARTIFACT_FOLDERS and entry.is_dir() and not entry.is_symlink():
            allowed = _ARTIFACT_FOLDERS[entry.name]
            inner = [p for p in entry.rglob("*") if not (p.is_file() and p.parent == entry and (
                p.name in allowed if allowed is not None else p.suffix == ".pyc"))]
            foreign += [f"{entry.name}/{p.relative_to(entry)}" for p in inner]
            continue
        foreign.append(entry.name + ("/" if entry.is_dir() else ""))
    return foreign


def plain_target(folder, writer: str) -> tuple[str, Path]:
    """(the path as given, its absolute target) after the refusals every writer shares: not a path,
    empty, `~`, a symlink, the current folder or one above it, the home folder."""
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"{writer}: the destination must be a folder path (str or os.PathLike), got "
                        f"{type(folder).__name__}.")
    text = os.fspath(folder)
    if not isinstance(text, str):
        raise TypeError(f"{writer}: the destination must be a folder path (str or os.PathLike), got bytes.")
    if text.strip() == "":
        raise DestinationError(f"{writer}: the destination is an empty path; name a new or empty folder.")
    if text == "~" or text.startswith("~/"):
        raise DestinationError(f"{writer}: {text!r} starts with '~', which is not expanded here; pass "
                               "os.path.expanduser(path) or a path without it.")
    path = Path(text)
    if path.is_symlink():
        raise DestinationError(f"{writer}: {text!r} is a symbolic link; name the folder itself (a replacement would "
                               "break the link).")
    target = path.resolve()
    cwd = Path.cwd().resolve()
    if target == cwd or target in cwd.parents:
        raise DestinationError(f"{writer}: {text!r} is the current folder or a folder above it; name a new or empty "
                               "folder for the output.")
    if target == Path.home().resolve():
        raise DestinationError(f"{writer}: {text!r} is the home folder; name a new or empty folder for the output.")
    return text, target


def check_writable(text: str, folder: Path, writer: str) -> None:
    """`folder` (or the nearest folder above it that exists, where it would be created) allows writing."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.is_dir() and not os.access(existing, os.W_OK | os.X_OK):
        raise DestinationError(f"{writer}: {text!r} is not writable ({existing} does not allow writing); name a "
                               "folder you can write to.")


def check_destination(folder, *, protected=(), writer: str = "hf_tangent") -> Path:
    """The absolute target of a folder write, after every refusal above (DestinationError).

    Args:
        folder: where the caller will write (created if missing, replaced whole if an artifact).
        protected: folders that must not be written over, hold the target or be held by it (the model's
            own base, the source being read); entries that are not folders are ignored.
        writer: the caller's name for messages ("hf_tangent.save_patch").
    """
    text, target = plain_target(folder, writer)
    for other in protected:
        if not other or not isinstance(other, (str, os.PathLike)) or not os.path.isdir(other):
            continue
        guarded = Path(other).resolve()
        if target == guarded or target in guarded.parents or guarded in target.parents:
            where = "is" if target == guarded else "holds" if target in guarded.parents else "is inside"
            raise DestinationError(f"{writer}: {text!r} {where} {guarded}, which this save reads from (the base model "
                                   "or the source); write to a folder outside it.")
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise DestinationError(f"{writer}: {text!r}: {parent} is a file, not a folder.")
            break
    if target.exists() and not target.is_dir():
        raise DestinationError(f"{writer}: {text!r} is a file, not a folder; remove it or name another folder.")
    if target.is_dir() and os.path.ismount(target):
        raise DestinationError(f"{writer}: {text!r} is a mount point, which cannot be replaced in one step; name a "
                               "folder inside it.")
    check_writable(text, target.parent, writer)  # the stage is made beside the target
    if target.is_dir() and any(target.iterdir()):
        kind = artifact_kind(target)
        extra = foreign_entries(target, kind)
        if extra and kind is None:
            raise DestinationError(f"{writer}: {text!r} is a non-empty folder that hf_tangent did not write (it holds "
                                   f"{', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}); hf_tangent writes "
                                   "into a new or empty folder or a Trainer output_dir, or replaces a patch repo or "
                                   "patched folder it wrote.")
        if extra:
            raise DestinationError(f"{writer}: {text!r} is an hf_tangent {kind} that also holds files hf_tangent does "
                                   f"not write ({', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}); replacing it "
                                   "would delete them. Move them out, or write to another folder.")
    return target


# ----------------------------------------------------------------------------- crash consistency
_NO_FLOCK = object()  # _lock's answer on a filesystem without flock (some network and FUSE mounts)


_HELD = object()  # _lock's answer for a folder this thread holds already
_THREAD = threading.local()  # .held: {(st_dev, st_ino)} of the folders this thread holds a flock on


def _held() -> set:
    if not hasattr(_THREAD, "held"):
        _THREAD.held = set()
    return _THREAD.held


def _lock(path: Path, *, wait: bool):
    """A descriptor holding an exclusive flock on the folder `path` (module docstring); None when another
    process holds it (and `wait` is false), the folder went away or another took its name meanwhile, or it is
    not ours to open; _NO_FLOCK where the filesystem has no flock (a writer goes on without the lock; a leftover
    there is left alone); _HELD for a folder this thread holds (flock locks an open file description: a second
    one would wait for this thread)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        key = (os.fstat(fd).st_dev, os.fstat(fd).st_ino)
        if key in _held():
            os.close(fd)
            return _HELD
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.path.samestat(os.fstat(fd), os.stat(path)):  # still the folder of that name
            _held().add(key)
            return fd
    except BlockingIOError:
        pass
    except OSError as err:
        os.close(fd)
        return None if isinstance(err, FileNotFoundError) else _NO_FLOCK
    except BaseException:  # an interrupt: never a lock left held (or registered) for the life of the process
        _held().discard((os.fstat(fd).st_dev, os.fstat(fd).st_ino))
        os.close(fd)
        raise
    os.close(fd)
    return None


def _hold(path: Path, fds: list[int], *, wait: bool) -> bool:
    """Lock `path` for this writer (its descriptor kept in `fds`); True also where there is no flock to take
    or this thread holds it already."""
    fd = _lock(path, wait=wait)
    if isinstance(fd, int):
        fds.append(fd)
    return fd is not None


def _beside(target: Path, state: str, ident: str) -> Path:
    """.NAME.hf_tangent-STATE-ID beside `target` (module docstring): made from the target's name and the stage's id."""
    return target.parent / f".{target.name}.hf_tangent-{state}-{ident}"


def _new_stage(target: Path, fds: list[int], *, under_parent: bool = True) -> Path:
    """An empty folder beside `target`, locked by this process until its descriptor in `fds` is closed. Made and
    locked under the parent's lock, which recover() holds while it looks, so that no recover() finds it unlocked
    and removes it as a killed save's leftover (and says so); `under_parent=False` for a writer that holds
    `target`'s lock already (recover() and replacing() take the parent's first: the other order could deadlock)."""
    parent: list[int] = []
    try:
        for _ in range(100):  # without the parent's lock, a recover() may remove a stage before it is locked
            if under_parent:
                _hold(target.parent, parent, wait=True)
            stage = _beside(target, "staging", os.urandom(4).hex())
            stage.mkdir()  # the mode a new folder gets here (umask), unlike mkdtemp's 0700
            if _hold(stage, fds, wait=False):
                return stage
            _close(parent)
    finally:
        _close(parent)
    raise DestinationError(f"hf_tangent: could not lock a stage beside {target} (another process removed each one).")


@contextlib.contextmanager
def stage(target: Path):
    """A new folder beside `target` (.NAME.hf_tangent-staging-ID) that this process holds until the block ends,
    then removed if still there; one a killed process left, `recover(target)` removes."""
    fds: list[int] = []
    path = _new_stage(target, fds)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        _close(fds)


def build_cache(target: Path, build, complete) -> None:
    """A cache folder made once (a converted model, an extracted corpus): `build(stage)` fills a stage beside
    `target`, which moves in by one rename; where another process got there first, its folder stays if
    `complete(target)`. What a killed build left is removed by the next (`recover`)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    recover(target)
    with stage(target) as staging:
        staging.chmod(0o755)
        build(staging)
        try:
            os.replace(staging, target)
        except OSError:
            if not complete(target):
                raise


def _abandoned(target: Path, fds: list[int]) -> dict[str, list[Path]]:
    """{"staging" / "ready" / "old": the leftovers beside `target` no live writer holds}, newest first, each
    locked (its descriptor in `fds`) while recover() acts on it."""
    found: dict[str, list[Path]] = {"staging": [], "ready": [], "old": [], "earlier": [], "into": [], "done": []}
    try:
        entries = list(target.parent.iterdir())
    except OSError:
        return found
    for entry in entries:
        match = _LEFTOVER.fullmatch(entry.name)
        if match is None or match["name"] != target.name or entry.is_symlink() or not entry.is_dir():
            continue
        fd = _lock(entry, wait=False)
        if isinstance(fd, int):
            fds.append(fd)
            found[match["state"]].append(entry)
        elif fd is _NO_FLOCK:
            logger.warning("hf_tangent: %s is left as it is: this filesystem has no flock, so whether a save is still "
                           "writing it cannot be told; remove it by hand once none is.", entry)
    for paths in found.values():
        paths.sort(key=lambda p: p.stat().st_mtime_ns, reverse=True)
    return found


def _close(fds: list[int]) -> None:
    for fd in fds:
        stat = os.fstat(fd)
        _held().discard((stat.st_dev, stat.st_ino))
        os.close(fd)
    fds.clear()


def recover(folder, *, writer: str = "hf_tangent") -> None:
    """Finish or roll back what a killed writer of `folder` left (module docstring), each step logged.
    Called by every writer before it writes and by the loaders before they read; one at a time per parent
    folder (its flock), so two never split one save's leftovers between them. A live save's own stages are
    locked and left alone; a save holding the folder's lock settled what others left before it wrote."""
    target = Path(os.path.abspath(os.fspath(folder)))
    fds: list[int] = []
    try:
        _hold(target.parent, fds, wait=True)
        _recover(target, writer)
    finally:
        _close(fds)


def _recover(target: Path, writer: str) -> None:
    """recover()'s work, under the parent's lock."""
    fds: list[int] = []
    try:
        found = _abandoned(target, fds)
        for earlier in found.pop("earlier"):  # an output_dir write (module docstring)
            ident = _LEFTOVER.fullmatch(earlier.name)["id"]
            into = _beside(target, "into", ident)
            if not target.is_dir():  # the output_dir is gone: so is what was being written into it
                done = "removed: the folder no longer exists"
            elif into in found["into"]:
                found["into"].remove(into)
                _move_in(into, target)
                os.replace(earlier, _beside(target, "done", ident))  # never rolled back from here
                earlier = _beside(target, "done", ident)
                done = "finished: the rest of it moved in"
            elif os.path.lexists(into):  # its writer is still there (it holds -into-): its own to finish
                continue
            else:
                for entry in sorted(earlier.iterdir(), key=lambda e: e.name in _RECORDS):
                    os.replace(entry, target / entry.name)
                done = "rolled back: the earlier save's files moved back"
            shutil.rmtree(earlier, ignore_errors=True)
            shutil.rmtree(into, ignore_errors=True)
            logger.warning("%s: an interrupted save into %s was %s.", writer, target, done)
        if target.is_dir():
            for into in found["into"]:  # finished but for removing the emptied stage (removed below)
                _move_in(into, target)
        if not os.path.lexists(target):
            for state, done in (("ready", "finished: the new content moved in"),
                                ("old", "rolled back: the previous content moved back")):
                if found[state]:
                    os.replace(found[state].pop(0), target)
                    logger.warning("%s: an interrupted save of %s was %s.", writer, target, done)
                    break
        for state, paths in found.items():
            for path in paths:
                shutil.rmtree(path, ignore_errors=True)
                done = "could not remove" if os.path.lexists(path) else "removed"
                logger.warning("%s: %s %s, left by an interrupted save of %s (%s).", writer, done, path.name, target,
                               {"staging": "incomplete", "ready": "not moved in", "old": "the replaced content",
                                "into": "emptied", "done": "the replaced content"}[state])
    finally:
        _close(fds)


_OWN_STAGES: set[Path] = set()  # the stages this process is writing (save_hub_folder saves the model into one)


@contextlib.contextmanager
def replacing(folder, *, protected=(), writer: str = "hf_tangent"):
    """Yields an empty folder to write into; on a clean exit its content is `folder`'s, moved in as
    the module docstring says (a new folder, an empty one, an artifact of ours: staged alike; an
    output_dir: written into). Files other writers put in a folder that is not yet an artifact (a
    tokenizer saved first, Trainer state) are carried over, the tokenizer's only when the save writes
    none of its own; an artifact is replaced whole. On any error before the move `folder` is as it was."""
    _, path = plain_target(folder, writer)  # the refusals that need no look inside, before anything moves
    if path in _OWN_STAGES:
        yield path  # a stage of this process (save_hub_folder's model save): not yet visible, written in place
        return
    recover(folder, writer=writer)
    target = check_destination(folder, protected=protected, writer=writer)
    carried = target.is_dir() and artifact_kind(target) is None
    target.parent.mkdir(parents=True, exist_ok=True)
    fds: list[int] = []
    staging = _new_stage(target, fds)
    ident = staging.name[-8:]
    _OWN_STAGES.add(staging)
    spare = None
    try:
        yield staging
        # one writer of a folder at a time, held while its content is aside or written into (no recover() takes
        # it); the parent's lock first, as recover() takes them, and only until a save killed meanwhile is settled
        parent: list[int] = []
        try:
            _hold(target.parent, parent, wait=True)
            locked = False
            for _ in range(10):  # the name may hold another folder after the wait (a save moved in, or a
                # killed one comes back in recover): lock that one
                _recover(target, writer)
                if locked or not target.is_dir():
                    break
                locked = _hold(target, fds, wait=True)
            else:
                raise DestinationError(f"{writer}: {target} kept changing while this save waited for it; nothing "
                                       "was replaced.")
            if target.is_dir() and any(map(_output_dir_entry, target.iterdir())):  # _write_into's aside, made here
                spare = _new_stage(target, fds)  # under the parent's lock (this thread holds it: no wait)
        finally:
            _close(parent)
        check_destination(folder, protected=protected, writer=writer)  # it may have changed while we wrote
        if target.is_dir() and any(map(_output_dir_entry, target.iterdir())):
            _OWN_STAGES.discard(staging)
            staging = _write_into(target, staging, ident, fds, spare)
            return
        if target.is_dir():
            staging.chmod(target.stat().st_mode & 0o7777)
            own_tokenizer = any((staging / name).exists() for name in _TOKENIZER_FILES)  # never two tokenizers mixed
            for entry in sorted(target.iterdir()) if carried else ():
                if _is_neighbour(entry.name) and entry.is_file() and not (staging / entry.name).exists() and not (
                        own_tokenizer and entry.name in _TOKENIZER_FILES):
                    shutil.copy2(entry, staging / entry.name)
        dropped = _dropped(target, staging)
        ready = _beside(target, "ready", ident)
        os.replace(staging, ready)  # the lock goes with the folder
        _OWN_STAGES.discard(staging)
        staging = ready
        if target.is_dir() and any(target.iterdir()):
            aside = _beside(target, "old", ident)
            os.replace(target, aside)
            ours = os.stat(ready)
            try:
                os.replace(ready, target)
            except BaseException as err:
                _after_failed_move(target, aside, ours, err, writer)
                raise
            shutil.rmtree(aside, ignore_errors=True)
            if aside.exists():
                warnings.warn(f"{writer}: the previous content of {target} was replaced, but its old copy at {aside} "
                              "could not be removed; delete it by hand.", stacklevel=3)
        else:
            try:
                os.replace(ready, target)  # a new folder, or over an empty one (one rename)
            except OSError:
                if not os.path.lexists(target) or artifact_kind(target) is None:
                    raise
                raise DestinationError(f"{writer}: another save of {target} finished while this one was written; "
                                       "that save is kept, this one was not applied.") from None
        if dropped:
            logger.warning("%s: replacing %s dropped %s: not part of an hf_tangent artifact (files saved beside it, "
                           "maybe by someone else) and not written by this save; a folder's tokenizer and card are "
                           "the ones saved with it (save the tokenizer after the model's last save, or use "
                           "ht.save_hub_folder(model, folder, tokenizer=tokenizer)).", writer, target, ", ".join(dropped))
    finally:
        _OWN_STAGES.discard(staging)
        shutil.rmtree(staging, ignore_errors=True)
        if spare is not None:  # unused, or renamed to the aside (gone from this name)
            shutil.rmtree(spare, ignore_errors=True)
        _close(fds)


def _after_failed_move(target: Path, aside: Path, ours: os.stat_result, err: BaseException, writer: str) -> None:
    """The move of this save onto `target` raised once the previous content was aside: one complete copy stays."""
    if not os.path.lexists(target):
        os.replace(aside, target)  # nothing took the name: the previous content goes back
    elif os.path.samestat(ours, os.stat(target)):
        shutil.rmtree(aside, ignore_errors=True)  # the move happened (an interrupt right after it): this save is in
    elif artifact_kind(target) is not None and isinstance(err, OSError):
        shutil.rmtree(aside, ignore_errors=True)  # another save of ours moved in meanwhile: it stays, this one goes
        raise DestinationError(f"{writer}: another save of {target} finished while this one was written; that save "
                               "is kept, this one was not applied.") from None
    else:  # someone else wrote the name: the previous content is kept under a name no recover() takes
        kept = _beside(target, "kept", aside.name[-8:])
        os.replace(aside, kept)
        message = (f"{writer}: {target} was written by someone else while this save ran; nothing was replaced, and "
                   f"its previous content is kept at {kept}.")
        if isinstance(err, OSError):
            raise DestinationError(message) from None
        logger.error(message)


def _write_into(target: Path, staging: Path, ident: str, fds: list[int], spare: Path | None = None) -> Path:
    """Move a staged save into an output_dir (module docstring); every entry that is not the earlier save's stays
    as it is. A failure on the way undoes each move in reverse order, so each state between is one `recover`
    reads the same way. Returns the stage's last name (removed by the caller)."""
    ready, aside, into, spent = (_beside(target, state, ident) for state in ("ready", "earlier", "into", "done"))
    os.replace(staging, ready)  # complete; the lock goes with the folder
    moved: list[tuple[Path, Path]] = []  # (from, to), in order
    made = False
    try:
        if os.path.lexists(aside):
            raise DestinationError(f"hf_tangent: {aside} is in the way of this save (not made by it); remove it.")
        # the aside, made locked under a stage's name (never unlocked while named); made by replacing() under the
        # parent's lock unless the folder became an output_dir only since
        spare = spare or _new_stage(target, fds, under_parent=False)
        try:
            os.replace(spare, aside)
        except BaseException:
            shutil.rmtree(spare, ignore_errors=True)
            raise
        made = True
        if artifact_kind(target) is not None:  # then every entry is the Trainer's, a neighbour or ours (check_destination)
            old = [e for e in target.iterdir() if not (_output_dir_entry(e) or _is_neighbour(e.name) and e.is_file()
                                                       or _LEFTOVER.fullmatch(e.name))]
            for entry in sorted(old, key=lambda e: e.name not in _RECORDS):
                os.replace(entry, aside / entry.name)
                moved.append((entry, aside / entry.name))
        os.replace(ready, into)
        moved.append((ready, into))
        _move_in(into, target, aside, moved)
        os.replace(aside, spent)  # the save is final: recover() never rolls a -done- folder back
        moved.append((aside, spent))
    except BaseException:
        for source, destination in reversed(moved):  # back where each came from
            try:
                os.replace(destination, source)
            except OSError:  # what is left is a state recover() finishes or rolls back
                logger.error("%s: this save could not be undone; the next save or load of it finishes or rolls "
                             "it back (%s).", target, aside)
                raise
        if made:
            shutil.rmtree(aside, ignore_errors=True)
        shutil.rmtree(ready, ignore_errors=True)
        raise
    shutil.rmtree(spent, ignore_errors=True)
    return into


def _move_in(source: Path, target: Path, aside: Path | None = None, moved: list | None = None) -> None:
    """Each entry of `source` into `target`, the record last; a file of that name in `target` (a neighbour the save
    writes again: a card, a tokenizer file) moved to `aside` first, or replaced where there is none."""
    for entry in sorted(source.iterdir(), key=lambda e: e.name in _RECORDS):
        steps = [(target / entry.name, aside / entry.name)] if aside and (target / entry.name).is_file() else []
        for step in [*steps, (entry, target / entry.name)]:
            os.replace(*step)
            if moved is not None:
                moved.append(step)


def _dropped(target: Path, staging: Path) -> list[str]:
    """The files of `target` that its replacement by `staging` loses and that are not part of an hf_tangent
    artifact (a tokenizer, a card, Trainer state): what a user may have written. One the new content holds
    byte for byte is not lost."""
    if not target.is_dir():
        return []
    return [entry.name for entry in sorted(target.iterdir()) if entry.is_file() and _is_neighbour(entry.name)
            and not ((staging / entry.name).is_file() and filecmp.cmp(entry, staging / entry.name, shallow=False))]


class AtomicSave:
    """`save_pretrained` of a patched model (an instance attribute that patching sets and unpatching
    removes): transformers' own save_pretrained, into a staging folder that then replaces the target
    (`replacing`), so saving a patched model never writes over a user's files or its own base, and a
    re-save leaves no file of the earlier one. A push (push_to_hub=True) and the ranks that write
    nothing (is_main_process=False) only get the destination check."""

    def __init__(self, model):
        self.model = model

    def __call__(self, save_directory, *args, **kwargs):
        model = self.model
        own = type(model).save_pretrained
        writer = f"{type(model).__name__}.save_pretrained"
        protected = [getattr(model.config, "_name_or_path", None)]
        try:  # the arguments as transformers' own signature binds them (is_main_process may be positional)
            bound = inspect.signature(own).bind(model, save_directory, *args, **kwargs).arguments
        except TypeError:
            return own(model, save_directory, *args, **kwargs)  # transformers' own error
        flags = {**bound, **bound.get("kwargs", {})}
        if not flags.get("is_main_process", True):  # this rank writes nothing
            check_destination(save_directory, protected=protected, writer=writer)
            return own(model, save_directory, *args, **kwargs)
        if flags.get("push_to_hub") and "repo_id" not in flags:  # the repo is named after the folder, not the stage
            kwargs["repo_id"] = Path(os.fspath(save_directory)).name
        with replacing(save_directory, protected=protected, writer=writer) as staging:
            return own(model, staging, *args, **kwargs)
