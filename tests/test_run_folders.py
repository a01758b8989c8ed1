"""Issue 59 item 3: run folders by the Trainer's output_dir conventions (experiments/runs.py).

A recipe's output folder is new, empty, or holds only entries runs write (a user's file or a symbolic
link is refused by name, the folder untouched); one run holds it at a time (an OS file lock: a second
run, in a thread or another process, is refused by message; a killed holder blocks nothing); a rerun
replaces the files it writes atomically and leaves the rest (checkpoints accumulate); nothing is parsed
out of a file name. And issue 47's: a folder's tokenizer is the one saved with it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from faults import Steps, count_steps, kill_at
from transformers import AutoTokenizer, LlamaForCausalLM

import hf_tangent as ht
from hf_tangent import cli
from hf_tangent.core.destinations import DestinationError
from hf_tangent.experiments.report import Report
from hf_tangent.experiments.runs import LOCK, RunFolder, claim_run_folder

IN_USE = "is in use by another hf_tangent run (it holds .hf_tangent.lock there); accepted: this folder once that run " \
         "has ended, or another folder."


def _texts(austen_dir: Path, tmp_path: Path) -> tuple[str, str]:
    """Short evaluation and calibration files (the openings of two novels): enough windows, fast to read."""
    paths = []
    for novel in ("emma", "prideprejudice"):
        path = tmp_path / f"{novel}.txt"
        path.write_text((austen_dir / f"{novel}.txt").read_text(encoding="utf-8")[:20000], encoding="utf-8")
        paths.append(str(path))
    return paths[0], paths[1]


def tree(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


def _small_report(nll: float = 1.0) -> Report:
    """An `eval` report (a kind without plots)."""
    rows = [{"variant": "unpatched", "nll": nll, "perplexity": 2.718, "delta_nll": 0.0, "delta_perplexity": 0.0,
             "tokens": 10, "config": None}]
    return Report("eval", {"command": "eval", "model": "m", "text": "t", "seq_len": 8, "windows": 1,
                           "tokens_per_variant": 10, "seconds": 0.1, "rows": rows, "unpatched_is": "the model",
                           "device": "cpu", "dtype": "float32", "seed": 0, "threads": 1, "torch": "x",
                           "hf_tangent_version": "x", "python": "x", "peak_rss_gb": 0.1})


def _earlier_run(folder: Path) -> dict:
    """A folder an earlier run wrote: its report, a model/, runs/seed1/ and a Trainer checkpoint."""
    _small_report(1.0).save(folder)
    (folder / "model").mkdir()
    (folder / "model" / "config.json").write_text("{}")
    (folder / "runs" / "seed1" / "checkpoint-4").mkdir(parents=True)
    (folder / "checkpoint-2").mkdir()
    (folder / "checkpoint-2" / "trainer_state.json").write_text('{"global_step": 2}')
    return tree(folder)


# ----------------------------------------------------------------------------- a rerun
def test_a_calibrate_rerun_replaces_its_report_and_patch(tiny_lm_folder, austen_dir, tmp_path):
    """The second run's report and patch replace the first's; the first run's model/, which the second does not
    write, stays (the Trainer's convention: the folder is not cleared), and the report says which is whose."""
    out = tmp_path / "run"
    evaluation, calibration = _texts(austen_dir, tmp_path)
    common = ["calibrate", "--model", str(tiny_lm_folder), "--text-files", evaluation,
              "--calibration-files", calibration, "--seq-len", "32", "--max-windows", "2",
              "--train-windows", "8", "--per-device-train-batch-size", "4", "--output-dir", str(out)]
    assert cli.main([*common, "--max-steps", "3", "--learning-rate", "0.05", "--save-full-model", "true"]) == 0
    first = json.loads((out / "report.json").read_text())
    model = tree(out / "model")
    assert cli.main([*common, "--max-steps", "2", "--learning-rate", "0.01"]) == 0
    second = json.loads((out / "report.json").read_text())
    assert second["gates"] != first["gates"] and "model_folder" not in second
    assert sorted(p.name for p in out.iterdir()) == [LOCK, "gate_profile.png", "loss_curve.png", "model", "patch",
                                                    "report.json", "report.md"]
    assert tree(out / "model") == model
    card = (out / "patch" / "README.md").read_text()  # the kept patch repo says what made it
    assert f"hf_tangent {ht.__version__}, torch {torch.__version__}" in card
    assert f"Starting weights: blake2b {second['weights']['digest'][:16]}" in card
    patched = ht.from_pretrained(out / "patch")  # the patch is the second run's, as its report says
    assert {str(c.index): pytest.approx(c.gate.item(), abs=1e-6) for c in ht.tangent_layers(patched)} == second["gates"]


def test_a_rerun_replaces_the_files_it_writes_by_rename_and_leaves_the_rest(tmp_path):
    folder = tmp_path / "run"
    before = _earlier_run(folder)
    with Steps() as steps:
        _small_report(2.0).save(folder)
    after = tree(folder)
    assert json.loads(after["report.json"])["rows"][0]["nll"] == 2.0 and after["report.md"] != before["report.md"]
    assert {k: v for k, v in after.items() if not k.startswith("report.")} == {
        k: v for k, v in before.items() if not k.startswith("report.")}  # checkpoints, model/, runs/ as they were
    # report.md and report.json are never opened in place: each is written under a temporary name and renamed over
    assert not [s for s in steps.log if s in (f"open({folder}/report.json)", f"open({folder}/report.md)")]
    renames = [s for s in steps.log if s.startswith("replace(")]
    assert len(renames) == 2 and [s for s in steps.log if s.startswith("open(")] == [
        r.replace("replace(", "open(") for r in renames]
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == [LOCK]


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_an_error_at_each_step_of_a_report_save_leaves_the_earlier_report_and_no_temporary_file(tmp_path):
    """An OSError at each step: report.json is the earlier one and no temporary file is left; a failed removal of
    the empty scratch folder (rmtree(ignore_errors=True) swallows it) leaves it to the folder's next run."""
    folder = tmp_path / "run"
    before = _earlier_run(folder)
    new = tree(_small_report(2.0).save(tmp_path / "new"))
    steps = count_steps(lambda: _small_report(2.0).save(folder))
    raised = []
    for n in range(1, len(steps) + 1):
        _small_report(1.0).save(folder)
        try:
            with Steps(fail=n):
                _small_report(2.0).save(folder)
        except OSError as err:
            assert f"injected failure at step {n}:" in str(err)
            raised.append(steps[n - 1].split("(")[0])
            assert tree(folder)["report.json"] == before["report.json"] and _hidden(folder) == [LOCK], steps[n - 1]
        else:
            assert tree(folder)["report.json"] == new["report.json"]
        with RunFolder(folder):
            assert _hidden(folder) == [LOCK]
    assert [name for name in raised if name in ("open", "replace")] == ["open", "replace"] * 2  # each write raised


def test_a_kill_at_each_step_of_a_report_save_leaves_a_folder_the_next_run_takes(tmp_path):
    """SIGKILL before each step (a forked child): report.json is the old or the new one, never missing or
    partial; the dead child's lock blocks nothing, and the next run removes the temporary file it left."""
    folder = tmp_path / "run"
    before = _earlier_run(folder)
    new = tree(_small_report(2.0).save(tmp_path / "new"))
    for n in range(1, len(count_steps(lambda: _small_report(2.0).save(tmp_path / "count"))) + 1):
        assert kill_at(lambda: _small_report(2.0).save(folder), n) == "killed"
        assert tree(folder)["report.json"] in (before["report.json"], new["report.json"])
        with RunFolder(folder):
            assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == [LOCK]
        _small_report(1.0).save(folder)
        assert tree(folder) == before


def test_a_killed_patch_save_in_a_run_folder_is_finished_by_the_next_save(tiny_lm_folder, tmp_path):
    """A kill between the staged write's renames (core/destinations.py) leaves .patch.hf_tangent-ready-...; the
    folder is still a run's, and the next save_patch into it moves the new content in."""
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    model = ht.patch(LlamaForCausalLM.from_pretrained(tiny_lm_folder).eval(), ht.TangentConfig(update="projected"))
    folder = tmp_path / "run"
    ht.save_patch(model, tmp_path / "ready")
    folder.mkdir()
    os.rename(tmp_path / "ready", folder / f".patch.hf_tangent-ready-{dead}-0123abcd")
    with RunFolder(folder):
        ht.save_patch(model, folder / "patch")
    assert sorted(p.name for p in folder.iterdir()) == [LOCK, "patch"]


def test_a_run_that_fails_before_writing_leaves_no_folder_it_created(tmp_path):
    with pytest.raises(RuntimeError, match="refused"), RunFolder(tmp_path / "new" / "out"):
        assert _hidden(tmp_path / "new" / "out") == [LOCK]
        raise RuntimeError("refused")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()  # the folder was there: it stays, and so does a file the failed run wrote
    with pytest.raises(RuntimeError, match="refused"), RunFolder(tmp_path / "kept"):
        raise RuntimeError("refused")
    assert (tmp_path / "kept").is_dir()
    with pytest.raises(RuntimeError, match="failed"), RunFolder(tmp_path / "wrote"):
        (tmp_path / "wrote" / "checkpoint-1").mkdir()
        raise RuntimeError("failed")
    assert sorted(p.name for p in (tmp_path / "wrote").iterdir()) == [LOCK, "checkpoint-1"]


# ----------------------------------------------------------------------------- whose folder it is
def test_a_users_files_beside_a_run_are_left_as_they_are(tiny_lm_folder, tmp_path, capsys):
    """The Trainer's output_dir convention, and the habit `hf-tangent eval --output-dir out > out/log` (the shell
    creates out/log first; it was refused): the run writes its entries beside the user's, which do not change."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "checkpoint-3").mkdir()
    (folder / "thesis.tex").write_text("mine")
    (folder / "notes").mkdir()
    (folder / "log").write_text("")
    before = tree(folder)
    _small_report().save(folder)
    assert cli.main(["eval", "--model", str(tiny_lm_folder), "--output-dir", str(folder), "--max-windows", "1",
                     "--seq-len", "16"]) == 0
    assert {k: v for k, v in tree(folder).items() if k in before} == before
    assert json.loads((folder / "report.json").read_text())["command"] == "eval"
    assert not (tmp_path / "new").exists() and claim_run_folder(tmp_path / "new") and not (tmp_path / "new").exists()


def test_a_users_files_with_a_runs_names_are_left_as_they_are(tmp_path):
    """A README.md and a model/ of the user's: a report is written beside them, and nothing of them changes (a run
    that writes model/ is refused there by the staged write: not an artifact of ours)."""
    folder = tmp_path / "named"
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "my_weights.txt").write_text("mine")
    (folder / "README.md").write_text("# my notes")
    before = tree(folder)
    _small_report().save(folder)
    assert {k: v for k, v in tree(folder).items() if k in before} == before
    assert sorted(tree(folder)) == sorted([*before, LOCK, "report.json", "report.md"])


def test_a_symbolic_link_among_the_entries_is_refused_and_never_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    for name in ("patch", "report.json", LOCK):
        folder = tmp_path / f"run-{name}"
        folder.mkdir()
        (folder / name).symlink_to(elsewhere if name == "patch" else elsewhere / "keep.txt")
        with pytest.raises(DestinationError, match=rf"holds symbolic links \({name}\) where a run writes; a run "
                                                   "writes its own entries and never follows a link"):
            _small_report().save(folder)
        assert sorted(p.name for p in folder.iterdir()) == [name]
    assert tree(elsewhere) == {"keep.txt": b"mine"}


def test_nothing_is_parsed_out_of_a_file_name(tmp_path):
    """A hidden phase folder of an earlier release with a 20-digit process id crashed writers (OverflowError); now
    it is an entry like any other, left as it is. The mark of an earlier release is never read (a forged pid is
    nothing)."""
    folder = tmp_path / "run"
    name = ".hf_tangent-run-earlier-99999999999999999999-deadbeef"
    (folder / name).mkdir(parents=True)
    (folder / name / "report.json").write_text("{}")
    _small_report().save(folder)
    assert (folder / name / "report.json").read_text() == "{}"
    (folder / ".hf_tangent-run.json").write_text('{"hf_tangent": "run folder", "pid": Infinity, "host": "h"}')
    _small_report().save(folder)
    assert (folder / ".hf_tangent-run.json").read_text().endswith('"host": "h"}')


def test_an_input_inside_the_output_folder_is_refused_before_anything_is_read(tiny_lm_folder, tmp_path, capsys):
    """`eval --model runs/latest/patch --output-dir runs/latest`: the run would replace what it reads. Refused,
    naming both; a checkpoint of the folder is an input of a resumed run."""
    folder = tmp_path / "latest"
    ht.save_patch(ht.patch(LlamaForCausalLM.from_pretrained(tiny_lm_folder).eval(), ht.TangentConfig(update="projected")),
                  folder / "patch", base_model=str(tiny_lm_folder))
    _small_report().save(folder)
    (folder / "checkpoint-3").mkdir()
    before = tree(folder)
    assert cli.main(["eval", "--model", str(folder / "patch"), "--output-dir", str(folder), "--max-windows", "1",
                     "--seq-len", "16"]) == 2
    assert f"--model {str(folder / 'patch')!r} lies inside the output folder {str(folder)!r}" in capsys.readouterr().err
    assert cli.main(["lm-eval-merge", str(folder / "report.json"), "--output_dir", str(folder)]) == 2
    assert f"a report to merge {str(folder / 'report.json')!r} lies inside" in capsys.readouterr().err
    with pytest.raises(DestinationError, match=r"model= '.*latest/patch' lies inside the output folder"):
        ht.calibrate_gates(str(folder / "patch"), training_args=ht.TangentTrainingArguments(output_dir=str(folder)))
    assert tree(folder) == before
    with RunFolder(folder, inputs={"--resume_from_checkpoint": str(folder / "checkpoint-3")}):
        pass


# ----------------------------------------------------------------------------- one run at a time
def test_a_second_run_into_a_folder_a_thread_holds_is_refused(tmp_path):
    folder = tmp_path / "held"
    held, done = threading.Event(), threading.Event()

    def first():
        with RunFolder(folder):
            held.set()
            done.wait(30)

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert held.wait(30)
        with pytest.raises(DestinationError, match=f"^Report.save: {re.escape(repr(str(folder)) + ' ' + IN_USE)}$"):
            _small_report().save(folder)
    finally:
        done.set()
        thread.join()
    assert _hidden(folder) == [LOCK] and not (folder / "report.json").exists()
    with RunFolder(folder):  # ended: the next run gets in; a RunFolder inside it, in its thread, is that run's
        _small_report().save(folder)
    assert sorted(p.name for p in folder.iterdir()) == [LOCK, "report.json", "report.md"]


HOLDER = """
import sys
from hf_tangent.experiments.runs import RunFolder
with RunFolder(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.readline()
"""


def test_a_second_run_into_a_folder_another_process_holds_is_refused_and_a_killed_one_blocks_nothing(tmp_path):
    folder = tmp_path / "held"
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "held\n"
        with pytest.raises(DestinationError, match=f"^Report.save: {re.escape(repr(str(folder)) + ' ' + IN_USE)}$"):
            _small_report().save(folder)
        assert sorted(p.name for p in folder.iterdir()) == [LOCK]
    finally:
        child.kill()  # SIGKILL: the OS releases its lock; the lock file stays
        child.wait()
    _small_report().save(folder)
    assert sorted(p.name for p in folder.iterdir()) == [LOCK, "report.json", "report.md"]


# ----------------------------------------------------------------------------- tokenizer files
def _tokenizer_files(folder: Path) -> set[str]:
    from hf_tangent.core.destinations import _TOKENIZER_FILES

    return {p.name for p in folder.iterdir()} & _TOKENIZER_FILES


def test_a_hub_folder_resaved_with_a_tokenizer_has_that_tokenizer_only(tiny_lm_folder, tmp_path):
    """The issue's case: a folder saved with a tokenizer of 514 entries (other special tokens, and the
    vocab.json / merges.txt / special_tokens_map.json / added_tokens.json files of its format), re-saved
    with one of 512: AutoTokenizer loaded the earlier one's extras. Now the folder holds exactly what
    the new tokenizer writes, and loads as it."""
    model = ht.patch(LlamaForCausalLM.from_pretrained(tiny_lm_folder).eval(), ht.TangentConfig(update="projected"))
    other = AutoTokenizer.from_pretrained(tiny_lm_folder)
    other.add_special_tokens({"additional_special_tokens": ["<tool>", "<call>"]})
    folder = tmp_path / "hub"
    ht.save_hub_folder(model, folder, tokenizer=other)
    for name, text in (("vocab.json", "{}"), ("merges.txt", "#version: 0.2\n"), ("added_tokens.json", '{"<tool>": 1}'),
                       ("special_tokens_map.json", '{"additional_special_tokens": ["<tool>", "<call>"]}')):
        (folder / name).write_text(text)  # the files the earlier tokenizer's format wrote
    tokenizer = AutoTokenizer.from_pretrained(tiny_lm_folder)
    ht.save_hub_folder(model, folder, tokenizer=tokenizer)
    alone = tmp_path / "alone"
    tokenizer.save_pretrained(alone)
    assert _tokenizer_files(folder) == _tokenizer_files(alone)
    loaded = AutoTokenizer.from_pretrained(folder)
    assert len(loaded) == len(tokenizer) and loaded.all_special_tokens == tokenizer.all_special_tokens
    # a model saved without a tokenizer over that folder: no tokenizer at all, not the earlier one
    model.save_pretrained(folder)
    assert _tokenizer_files(folder) == set()
    with pytest.raises((OSError, ValueError, TypeError)):
        AutoTokenizer.from_pretrained(folder)


def test_a_tokenizer_saved_before_the_first_save_is_kept_but_never_mixed(tiny_lm_folder, tmp_path):
    model = ht.patch(LlamaForCausalLM.from_pretrained(tiny_lm_folder).eval(), ht.TangentConfig(update="projected"))
    folder = tmp_path / "hub"
    tokenizer = AutoTokenizer.from_pretrained(tiny_lm_folder)
    tokenizer.save_pretrained(folder)
    (folder / "vocab.json").write_text("{}")  # as if a tokenizer of another format had been saved first
    ht.save_hub_folder(model, folder, tokenizer=tokenizer)  # it writes its own: none of the earlier files stay
    assert "vocab.json" not in _tokenizer_files(folder)
    assert torch.equal(torch.tensor(AutoTokenizer.from_pretrained(folder)("Emma")["input_ids"]),
                       torch.tensor(tokenizer("Emma")["input_ids"]))


def test_what_a_run_would_write_through_is_refused_before_the_run(tmp_path, capsys, tiny_lm_folder):
    """The fresh-eyes review of issue 59: a link one level below a run's entry was followed (the Trainer wrote its
    state into a file outside the folder); a report.json that is a folder, or a lock that is one, failed after
    the work (a raw IsADirectoryError, the new report.md beside the old report.json). Each is refused by name
    before anything is written; the folder is left as it was."""
    victim = tmp_path / "victim.json"
    victim.write_text("mine")
    cases = {"link": lambda f: ((f / "checkpoint-1").mkdir(), (f / "checkpoint-1" / "trainer_state.json").symlink_to(
                 victim)),
             "report": lambda f: ((f / "report.json").mkdir(), (f / "report.json" / "x").write_text("x")),
             "lock": lambda f: (f / LOCK).mkdir()}
    messages = {"link": "holds symbolic links (checkpoint-1/trainer_state.json) where a run writes",
                "report": "holds report.json as something else than a file",
                "lock": f"holds {LOCK} as something else than a file"}
    for name, make in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        make(folder)
        before = tree(folder)
        with pytest.raises(DestinationError, match=re.escape(messages[name])):
            _small_report().save(folder)
        assert cli.main(["eval", "--model", str(tiny_lm_folder), "--output-dir", str(folder), "--max-windows", "1",
                         "--seq-len", "16"]) == 2
        assert messages[name] in capsys.readouterr().err
        assert tree(folder) == before
    assert victim.read_text() == "mine"
