"""Issue 47: every writer is crash-consistent, and what it leaves is finished or rolled back by the next
writer or loader, with a log line.

Fault injection (tests/faults.py) counts every filesystem step of a writer (mkdir, rename, replace,
rmdir, unlink, chmod, rmtree, copy2, a file opened for writing, safetensors' save_file) and either
raises an OSError at step N or kills the process with SIGKILL before or after step N. The kills run
in tests/crash_worker.py, one process started with OMP_NUM_THREADS=1 that forks a child per kill
point (a process whose OpenMP pool has started cannot fork safely). After each kill or error the
target must be the old content or the new one, byte for byte, once the next reader has run (it
loads with the logits of that model), and the next writer must succeed and leave nothing else.

By default: every rename and the first step of each other kind, for a patch repo, an empty folder and a
Trainer output_dir written into (killed before the step), and for a complete folder (an error at the step).
With -m slow: every step of every writer (patch repo, complete folder, Hub folder with a tokenizer, a LoRA
patch repo, an empty folder, a new folder, an output_dir), killed before and after it and failing at it. (A run folder's files are each
replaced on their own: tests/test_run_folders.py kills and fails every step of a report's save.)"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import waits_in_flock
from transformers import LlamaForCausalLM

import hf_tangent as ht
from hf_tangent.core import destinations

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import crash_worker  # noqa: E402

ALL = tuple(crash_worker.SCENARIOS)


def worker(tmp_path, scenarios, steps, modes) -> dict:
    out = tmp_path / "walk.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run([sys.executable, str(HERE / "crash_worker.py"), str(out), ",".join(scenarios), steps,
                             ",".join(modes)], capture_output=True, text=True, timeout=1800, env=env,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(out.read_text())


def test_a_kill_at_each_rename_of_each_writer_leaves_the_old_or_the_new_content(tmp_path):
    walked = worker(tmp_path, ["patch_repo", "empty_folder", "output_dir"], "renames", ["before"])
    for name, entry in walked.items():
        renames = [k for k, s in enumerate(entry["steps"], 1) if s.startswith("replace(")]
        assert set(renames) <= set(entry["tested"]["before"]), name
    # the protocol's own steps are among them: the stage made, moved to ready, the old moved aside, moved in
    labels = [walked["patch_repo"]["steps"][k - 1] for k in walked["patch_repo"]["tested"]["before"]]
    for marker in (".hf_tangent-staging-", ".hf_tangent-ready-", "replace(", "rmtree(", "save_file("):
        assert any(marker in label for label in labels), marker


@pytest.mark.slow
def test_a_kill_or_an_error_at_every_step_of_every_writer_leaves_the_old_or_the_new_content(tmp_path):
    """The exhaustive walk (about 7 minutes here); its list of steps is the one docs/core.md describes."""
    walked = worker(tmp_path, ALL, "all", ["before", "after", "raise"])
    for name, entry in walked.items():
        assert all(entry["tested"][mode] == list(range(1, len(entry["steps"]) + 1)) for mode in entry["tested"]), name


@pytest.mark.filterwarnings("ignore:.*could not be removed:UserWarning")  # an rmtree made to fail: said, left for later
def test_an_error_at_each_rename_leaves_the_old_content(tmp_path):
    """In this process (nothing forks): an OSError at each rename and the first step of each other kind of
    a complete folder's save; a failed removal of the replaced content (warned) is finished by the next writer."""
    logging.getLogger("hf_tangent").setLevel(logging.ERROR)
    try:
        walked = crash_worker.run(tmp_path, ["patched_folder"], "renames", ["raise"])
    except SystemExit:
        pytest.fail("the error walk failed (see the captured stderr)")
    finally:
        logging.getLogger("hf_tangent").setLevel(logging.NOTSET)
    assert len(walked["patched_folder"]["tested"]["raise"]) >= 8


# ----------------------------------------------------------------------------- recovery, as a user meets it
def _dead_pid() -> int:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(child.stdout)


def _gated(folder, value):
    model = ht.patch(LlamaForCausalLM.from_pretrained(folder).eval(), ht.TangentConfig(update="projected", gates=True))
    with torch.no_grad():
        for child in ht.tangent_layers(model):
            child.gate.fill_(value)
    return model


def _logits(model):
    with torch.no_grad():
        return model(torch.arange(12)[None]).logits


def test_a_save_killed_between_its_renames_is_finished_by_the_next_loader(tiny_lm_folder, tmp_path, caplog):
    """The kill left no folder, the old content aside and the new one ready: ht.from_pretrained moves the new
    one in (logged) and loads it; nothing is left beside it."""
    old, new = _gated(tiny_lm_folder, 2.0), _gated(tiny_lm_folder, 0.5)
    pid = _dead_pid()
    old.save_pretrained(tmp_path / "aside")
    new.save_pretrained(tmp_path / "ready")
    os.rename(tmp_path / "aside", tmp_path / f".model.hf_tangent-old-{pid}-0123abcd")
    os.rename(tmp_path / "ready", tmp_path / f".model.hf_tangent-ready-{pid}-4567cdef")
    with caplog.at_level(logging.WARNING, logger="hf_tangent"):
        loaded = ht.from_pretrained(tmp_path / "model")
    assert torch.equal(_logits(loaded), _logits(new))
    assert "an interrupted save of" in caplog.text and "was finished: the new content moved in" in caplog.text
    assert "the replaced content" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_folders_named_like_an_earlier_releases_leftovers_are_never_touched(tiny_lm_folder, tmp_path):
    """Review of issue 47: 0.3's leftover names (.NAME.old-ID, .NAME.staging-ID, ID 8 hex digits) are also a
    user's names (.e.old-20240115: YYYYMMDD is 8 hex digits) and were treated as dead leftovers:
    ht.from_pretrained('e') deleted the user's .e.old-20240115, save_patch(model, 'd') removed
    .d.staging-12345678, and ht.from_pretrained('c') of a missing c moved .c.old-20240115 into c. Only names
    with hf_tangent's mark are hf_tangent's; a load never moves or deletes anything else."""
    model = _gated(tiny_lm_folder, 2.0)
    model.save_pretrained(tmp_path / "e")
    users = (".e.old-20240115", ".d.staging-12345678", ".c.old-20240115", ".e.staging-89abcdef")
    for name in users:
        (tmp_path / name).mkdir()
        (tmp_path / name / "notes.txt").write_text(name)
    assert torch.equal(_logits(ht.from_pretrained(tmp_path / "e")), _logits(model))
    ht.save_patch(model, tmp_path / "d")
    with pytest.raises(ValueError, match="c is not a saved model folder or hub repo"):
        ht.from_pretrained(tmp_path / "c")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*users, "d", "e"])
    assert all((tmp_path / name / "notes.txt").read_text() == name for name in users)


def test_a_resave_names_each_file_it_drops_that_hf_tangent_did_not_write(tiny_lm_folder, tmp_path, caplog):
    """Review of issue 47: docs/serving.md's pattern (save the model, then the tokenizer beside it) followed by a
    re-save of the model left no tokenizer and said nothing; save_hub_folder over a folder holding only the
    user's README.md replaced it silently; a save with tokenizer= over the user's vocab.json / merges.txt
    dropped them silently. A folder's tokenizer and card are still the ones saved with it (issue 47), but each
    file dropped that an artifact does not consist of is named in a warning of the "hf_tangent" logger; the
    order docs/serving.md gives (the tokenizer after the model's last save) keeps the tokenizer."""
    from transformers import AutoTokenizer

    model, tokenizer = _gated(tiny_lm_folder, 1.0), AutoTokenizer.from_pretrained(tiny_lm_folder)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    written = sorted(p.name for p in folder.iterdir() if p.name.startswith(("tokenizer", "special", "chat")))
    with caplog.at_level(logging.WARNING, logger="hf_tangent"):
        model.save_pretrained(folder)
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 1 and all(name in dropped[0] for name in written), (written, caplog.text)
    assert f"replacing {folder} dropped" in dropped[0] and "save the tokenizer after the model's last save" in dropped[0]
    tokenizer.save_pretrained(folder)  # the documented order: the tokenizer after the model's last save
    assert len(AutoTokenizer.from_pretrained(folder)) == len(tokenizer)

    caplog.clear()
    (tmp_path / "card").mkdir()
    (tmp_path / "card" / "README.md").write_text("my own notes")
    (tmp_path / "card" / "vocab.json").write_text("{}")
    (tmp_path / "card" / "merges.txt").write_text("#version: 0.2\n")
    with caplog.at_level(logging.WARNING, logger="hf_tangent"):
        ht.save_hub_folder(model, tmp_path / "card", tokenizer=tokenizer)
    assert "dropped README.md, merges.txt, vocab.json: not part of an hf_tangent artifact" in caplog.text, caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_tangent"):  # the same tokenizer and card again: nothing lost
        ht.save_hub_folder(model, tmp_path / "card", tokenizer=tokenizer)
    assert "dropped" not in caplog.text


def test_a_destination_inside_the_source_is_refused_naming_both(tiny_lm_folder, tmp_path, capsys):
    """Review of issue 47: `hf-tangent export --patch P --output P/sub` wrote a complete folder inside the patch
    repo, and a model loaded from a folder could be saved into a folder inside it."""
    from hf_tangent import cli
    from hf_tangent.core.destinations import DestinationError

    model = _gated(tiny_lm_folder, 1.0)
    patch = ht.save_patch(model, tmp_path / "patch", base_model=str(tiny_lm_folder))
    before = sorted(p.name for p in patch.iterdir())
    assert cli.main(["export", "--patch", str(patch), "--output", str(patch / "sub")]) == 2
    err = capsys.readouterr().err
    assert f"'{patch / 'sub'}' is inside {patch.resolve()}, which this save reads from" in err, err
    assert sorted(p.name for p in patch.iterdir()) == before
    model.save_pretrained(tmp_path / "full")
    loaded = ht.from_pretrained(tmp_path / "full")
    with pytest.raises(DestinationError, match=rf"'{tmp_path}/full/sub' is inside {tmp_path.resolve()}/full, which "
                                               "this save reads from"):
        loaded.save_pretrained(tmp_path / "full" / "sub")
    with pytest.raises(DestinationError, match="is inside"):
        ht.save_patch(model, Path(tiny_lm_folder) / "patch")
    assert not (tmp_path / "full" / "sub").exists() and not (Path(tiny_lm_folder) / "patch").exists()


def _holder(folder: Path) -> subprocess.Popen:
    """A live process that holds `folder`'s lock, as a writer does while it stages it."""
    code = (f"import fcntl, os, sys, time; fd = os.open({str(folder)!r}, os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); "
            "print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_killed_conversion_of_an_offline_model_is_cleaned_by_the_next_one(tmp_path, monkeypatch, caplog):
    """Review of issue 47: a killed conversion left ~540 MB in the cache, never cleaned. Its stage is the staged
    write's (destinations.stage), and the next conversion removes those no live process holds (logged), never
    a running one's or a folder of another name; the gguf assembly of Gemma-3 is made inside the stage."""
    import transformers

    from hf_tangent.artifacts import checkpoints

    monkeypatch.setenv("HF_TANGENT_CACHE", str(tmp_path))
    target = f"smollm2-135m-transformers{transformers.__version__.split('.')[0]}"
    names = {f".{target}.hf_tangent-staging-0123abcd": False, f".{target}.hf_tangent-staging-4567cdef": True,
             f".{target}.hf_tangent-staging-{10**20}-89abcdef": False,  # an earlier release's name: never parsed
             ".smollm2-135m-notes": True, "mine": True}
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"partial")
    holder = _holder(tmp_path / f".{target}.hf_tangent-staging-4567cdef")
    try:
        def stop(scratch):
            assert scratch.parent.name.startswith(f".{target}.hf_tangent-staging-") and not any(scratch.iterdir())
            raise RuntimeError("stopped before converting")

        with caplog.at_level(logging.WARNING, logger="hf_tangent"), pytest.raises(RuntimeError, match="stopped"):
            checkpoints._converted("smollm2-135m", stop)
    finally:
        holder.kill()
        holder.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for n, kept in names.items() if kept)
    assert f"removed .{target}.hf_tangent-staging-0123abcd, left by an interrupted save" in caplog.text


def test_the_stage_of_a_save_still_running_is_left_alone(tiny_lm_folder, tmp_path):
    """Liveness is the stage's lock, never a process id read from its name (a 20-digit one raised OverflowError)."""
    held, dead = tmp_path / ".patch.hf_tangent-staging-0123abcd", tmp_path / f".patch.hf_tangent-staging-{10**20}-4567cdef"
    held.mkdir()
    dead.mkdir()
    holder = _holder(held)
    try:
        ht.save_patch(_gated(tiny_lm_folder, 1.0), tmp_path / "patch")
        assert held.is_dir() and not dead.exists()  # another process's save in progress; a dead one's removed
    finally:
        holder.kill()
        holder.wait()
    ht.save_patch(_gated(tiny_lm_folder, 1.0), tmp_path / "patch")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["patch"]


def test_a_stage_is_never_seen_unlocked_by_another_recover(tiny_lm_folder, tmp_path, monkeypatch, caplog):
    """A stage was made, then locked: a recover() of another process between the two found it unlocked, removed
    it and logged 'removed .patch.hf_tangent-staging-..., left by an interrupted save' of a save that was running
    (the save went on under another name). It is made and locked under the parent's lock, which recover() holds
    while it looks: here a recover() started right after the stage's mkdir waits for it, then leaves it alone."""
    import threading

    made, mkdir = [], Path.mkdir

    def mkdir_then_recover(path, *args, **kwargs):
        mkdir(path, *args, **kwargs)
        if "-staging-" in path.name and not made:
            made.append(threading.Thread(target=destinations.recover, args=(tmp_path / "patch",)))
            made[0].start()
            waits_in_flock(made[0], seconds=5)  # it waits (it used to finish: the stage was unlocked)

    monkeypatch.setattr(Path, "mkdir", mkdir_then_recover)
    with caplog.at_level(logging.WARNING, logger="hf_tangent"):
        ht.save_patch(_gated(tiny_lm_folder, 0.5), tmp_path / "patch")
        made[0].join(60)
    assert not made[0].is_alive() and "interrupted save" not in caplog.text, caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["patch"]


def test_the_aside_of_an_output_dir_write_is_never_seen_unlocked_by_another_recover(tmp_path, monkeypatch, caplog):
    """The second stage of a write into an output_dir (the aside for the earlier save's files) was made while the
    writer held the folder's lock but not the parent's: a recover() between its mkdir and its lock removed it and
    logged a false 'interrupted save'. It is made under the parent's lock too."""
    import threading

    target, stages, mkdir = tmp_path / "out", [], Path.mkdir
    (target / "checkpoint-1").mkdir(parents=True)

    def mkdir_then_recover(path, *args, **kwargs):
        mkdir(path, *args, **kwargs)
        if "-staging-" in path.name:
            stages.append(threading.Thread(target=destinations.recover, args=(target,)))
            if len(stages) == 2:
                stages[1].start()
                waits_in_flock(stages[1], seconds=5)

    monkeypatch.setattr(Path, "mkdir", mkdir_then_recover)
    with caplog.at_level(logging.WARNING, logger="hf_tangent"):
        with destinations.replacing(target) as staging:
            (staging / "config.json").write_text("{}")
        stages[1].join(60)
    assert len(stages) == 2 and not stages[1].is_alive() and "interrupted save" not in caplog.text, caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in target.iterdir()) == ["checkpoint-1", "config.json"]


def test_an_empty_folder_is_staged_too_and_keeps_its_mode(tiny_lm_folder, tmp_path):
    """0.3 wrote into an existing empty folder in place: a kill left e.g. gates.safetensors alone, and
    every later save there was refused as a folder hf_tangent did not write. Now it is staged like any
    other destination (the kill walk's empty_folder scenario kills it at every step)."""
    from faults import Steps

    (tmp_path / "out").mkdir(mode=0o700)
    (tmp_path / "out").chmod(0o2750)
    with Steps() as steps:
        ht.save_patch(_gated(tiny_lm_folder, 1.0), tmp_path / "out")
    written = [s for s in steps.log if s.startswith(("save_file", "open("))]
    assert written and not [s for s in steps.log if s.startswith("open(") and f"{tmp_path}/out/" in s]
    assert (tmp_path / "out").stat().st_mode & 0o7777 == 0o2750
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["README.md", "adapter_config.json",
                                                                    "adapter_model.safetensors"]


def test_on_a_filesystem_without_flock_saves_go_on_and_leftovers_are_left(tiny_lm_folder, tmp_path, monkeypatch,
                                                                          caplog):
    """Review of issue 59: where flock is not supported (some network and FUSE mounts) every re-save was refused
    ("changed while this save was written") and a leftover was never looked at. Saves go on without the lock; a
    leftover is left as it is, with a log line saying why."""
    import errno

    from hf_tangent.core import destinations

    def no_flock(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(destinations.fcntl, "flock", no_flock)
    ht.save_patch(_gated(tiny_lm_folder, 1.0), tmp_path / "patch")
    leftover = tmp_path / ".patch.hf_tangent-staging-0123abcd"
    leftover.mkdir()
    new = _gated(tiny_lm_folder, 0.5)
    with caplog.at_level(logging.WARNING, logger="hf_tangent"):
        ht.save_patch(new, tmp_path / "patch")
    assert torch.equal(_logits(ht.from_pretrained(tmp_path / "patch")), _logits(new))
    assert sorted(p.name for p in tmp_path.iterdir()) == [leftover.name, "patch"]
    assert "this filesystem has no flock" in caplog.text


def test_a_save_that_another_writer_overtook_says_so_and_keeps_that_save(tiny_lm_folder, tmp_path, monkeypatch):
    """Review of issue 59: two writers of one folder; the other's save moved in between this one's two renames.
    That save is kept whole; this one raises a DestinationError that says so (was a raw 'Directory not empty' from
    the roll-back, and the next reader removed the aside copy with an 'interrupted save' warning)."""
    from hf_tangent.core import destinations
    from hf_tangent.core.destinations import DestinationError

    target = tmp_path / "patch"
    ht.save_patch(_gated(tiny_lm_folder, 1.0), target)
    other = _gated(tiny_lm_folder, 2.0)
    ht.save_patch(other, tmp_path / "other")
    replace = os.replace

    def overtaken(source, destination):
        if Path(destination) == target and ".hf_tangent-ready-" in Path(source).name:
            replace(tmp_path / "other", target)  # the other writer's rename, just before ours
        return replace(source, destination)

    monkeypatch.setattr(destinations.os, "replace", overtaken)
    with pytest.raises(DestinationError, match="another save of .* finished while this one was written; that save is "
                                               "kept, this one was not applied"):
        ht.save_patch(_gated(tiny_lm_folder, 0.5), target)
    monkeypatch.undo()
    assert torch.equal(_logits(ht.from_pretrained(target)), _logits(other))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["patch"]


def _moving_in(target: Path, before=None, after=None):
    """os.replace with `before()` run just before this save's ready stage moves onto `target`, `after()` just after."""
    replace = os.replace

    def move(source, destination):
        ours = Path(destination) == target and ".hf_tangent-ready-" in Path(source).name
        if ours and before:
            before()
        result = replace(source, destination)
        if ours and after:
            after()
        return result

    return move


def test_a_save_whose_folder_someone_else_wrote_meanwhile_keeps_the_previous_content(tiny_lm_folder, tmp_path,
                                                                                   monkeypatch):
    """Second review of issue 59: a writer that is not hf_tangent (a tokenizer save) made the folder while the previous
    content was aside; the 'another save finished' path deleted that content and this save's too, leaving a folder of
    one tokenizer file. Now the previous content is kept under a name no recover() takes, and the error names it."""
    from hf_tangent.core import destinations
    from hf_tangent.core.destinations import DestinationError

    target = tmp_path / "patch"
    old = _gated(tiny_lm_folder, 2.0)
    ht.save_patch(old, target)

    def tokenizer_save():
        target.mkdir()
        (target / "tokenizer_config.json").write_text("{}")

    monkeypatch.setattr(destinations.os, "replace", _moving_in(target, before=tokenizer_save))
    with pytest.raises(DestinationError, match=r"was written by someone else while this save ran; nothing was "
                                               r"replaced, and its previous content is kept at .*\.patch\.hf_tangent-kept-"):
        ht.save_patch(_gated(tiny_lm_folder, 0.5), target)
    monkeypatch.undo()
    [kept] = [p for p in tmp_path.iterdir() if ".hf_tangent-kept-" in p.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([kept.name, "patch"])
    assert torch.equal(_logits(ht.from_pretrained(kept)), _logits(old))
    destinations.recover(target)  # the next reader leaves it
    assert kept.is_dir()


def test_an_interrupt_right_after_the_move_is_raised_and_the_save_is_in(tiny_lm_folder, tmp_path, monkeypatch):
    """Second review of issue 59: Ctrl-C just after this save moved in was turned into 'this one was not applied'
    while the folder held it. The interrupt is raised as it came; the save is in; nothing is left beside it."""
    from hf_tangent.core import destinations

    target = tmp_path / "patch"
    ht.save_patch(_gated(tiny_lm_folder, 2.0), target)
    new = _gated(tiny_lm_folder, 0.5)

    def interrupt():
        raise KeyboardInterrupt

    monkeypatch.setattr(destinations.os, "replace", _moving_in(target, after=interrupt))
    with pytest.raises(KeyboardInterrupt):
        ht.save_patch(new, target)
    monkeypatch.undo()
    assert torch.equal(_logits(ht.from_pretrained(target)), _logits(new))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["patch"]


def test_an_output_dir_save_whose_stage_is_held_is_not_rolled_back_under_it(tmp_path, caplog):
    """An -earlier- folder whose -into- stage another process holds (it was listed by a recovery that ran beside
    this one) is left alone: rolling it back there, and the other finishing its -into-, made the old shards and
    index sit beside the new config and weights. Once the hold ends, the next recovery finishes the save."""
    out = tmp_path / "out"
    (out / "checkpoint-1").mkdir(parents=True)
    earlier, into = (tmp_path / f".out.hf_tangent-{state}-0123abcd" for state in ("earlier", "into"))
    earlier.mkdir()
    into.mkdir()
    for name, text in (("config.json", '{"hf_tangent": {"config": {}}, "v": "old"}'), ("model-00001-of-00002.safetensors", "old"),
                       ("model.safetensors.index.json", "old")):
        (earlier / name).write_text(text)
    (into / "model.safetensors").write_text("new")
    (into / "config.json").write_text('{"hf_tangent": {"config": {}}, "v": "new"}')
    (out / "README.md").write_text("new card")  # moved in before the kill
    holder = _holder(into)
    try:
        destinations.recover(out)
        assert sorted(p.name for p in out.iterdir()) == ["README.md", "checkpoint-1"]
        assert earlier.is_dir() and into.is_dir()
    finally:
        holder.kill()
        holder.wait()
    with caplog.at_level(logging.WARNING, logger="hf_tangent"):
        destinations.recover(out)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "checkpoint-1", "config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["v"] == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert "was finished: the rest of it moved in" in caplog.text


def _output_dir_leftovers(tmp_path: Path, out: Path) -> None:
    """What an output_dir save killed mid-move leaves: its card in, the earlier save aside, the rest staged."""
    earlier, into = (tmp_path / f".out.hf_tangent-{state}-0123abcd" for state in ("earlier", "into"))
    earlier.mkdir()
    into.mkdir()
    (earlier / "config.json").write_text('{"hf_tangent": {"config": {}}, "v": "old"}')
    (earlier / "model.safetensors").write_text("old")
    (into / "config.json").write_text('{"hf_tangent": {"config": {}}, "v": "killed"}')
    (into / "model-00001-of-00002.safetensors").write_text("killed")
    (out / "README.md").write_text("killed card")


def test_a_save_killed_while_another_was_written_is_settled_before_that_one_moves_in(tmp_path):
    """An output_dir save killed mid-move after this save's first recovery: this save settles it under the
    folder's lock before its last check, so the folder is this save alone, also after the next loader's
    recovery (which had finished the killed save over this one: its shard beside this config)."""
    out = tmp_path / "out"
    (out / "checkpoint-1").mkdir(parents=True)
    with destinations.replacing(out) as staging:
        (staging / "config.json").write_text('{"hf_tangent": {"config": {}}, "v": "this"}')
        (staging / "model.safetensors").write_text("this")
        _output_dir_leftovers(tmp_path, out)
    destinations.recover(out)  # the card stays: an output_dir's neighbour, which this save does not write
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "checkpoint-1", "config.json", "model.safetensors"]
    assert (out / "model.safetensors").read_text() == "this" and '"this"' in (out / "config.json").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_save_inside_this_threads_own_stage_does_not_wait_for_itself(tmp_path):
    """A save into a folder inside a stage this thread holds: its recovery locks the stage as the parent, which
    would wait for this thread (flock locks an open file description); answered as held, it goes on."""
    import threading

    done = []

    def nested():
        with destinations.replacing(tmp_path / "out") as outer:
            (outer / "README.md").write_text("card")
            with destinations.replacing(outer / "sub") as inner:
                (inner / "config.json").write_text('{"hf_tangent": {"config": {}}}')
        done.append(sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")))

    thread = threading.Thread(target=nested, daemon=True)
    thread.start()
    thread.join(60)
    assert done == [["out", "out/README.md", "out/sub", "out/sub/config.json"]]


def test_a_save_waiting_for_a_folder_that_another_save_replaced_replaces_that_one(tiny_lm_folder, tmp_path,
                                                                                monkeypatch):
    """Two saves of one patched folder at once: the second waits for the folder's lock while the first moves its
    content in (a new folder under the name), then locks that one and replaces it: the last save is the folder
    (it was refused as 'changed')."""
    import threading

    target = tmp_path / "folder"
    _gated(tiny_lm_folder, 2.0).save_pretrained(target)
    first, second = _gated(tiny_lm_folder, 0.5), _gated(tiny_lm_folder, 1.5)
    paused, resume, errors = threading.Event(), threading.Event(), []
    real = destinations._dropped

    def slow(*args):
        if threading.current_thread().name == "first":
            paused.set()
            resume.wait(60)
        return real(*args)

    def run(model):
        try:
            model.save_pretrained(target)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    monkeypatch.setattr(destinations, "_dropped", slow)
    threads = [threading.Thread(target=run, args=(m,), name=n) for m, n in ((first, "first"), (second, "second"))]
    threads[0].start()
    assert paused.wait(60)
    threads[1].start()
    assert waits_in_flock(threads[1])
    resume.set()
    for thread in threads:
        thread.join(60)
    assert errors == []
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        assert torch.equal(ht.from_pretrained(target)(ids).logits, second(ids).logits)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]
