"""Issue 47: a run folder holds the latest run only, and a folder's tokenizer is the one saved with it.

A rerun into the same output folder leaves nothing of the earlier run that it did not write again
(calibrate with --save_full_model, then without it: no model/ of the first run's gates beside the
second report; heal --seeds 0 1, then --seeds 0: no runs/seed1); a run that fails gives the earlier
run back; one stopped with a Trainer checkpoint keeps it to resume from. (The kills at every step
of a run's claim, its writes and its commit: test_crash_consistency.py.)"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

import hf_tangent as ht
from hf_tangent import cli
from hf_tangent.core.destinations import DestinationError
from hf_tangent.experiments.report import Report
from hf_tangent.experiments.runs import MARK, RunFolder, recover_run_folder

# the mark every run leaves in its folder, as a run that ended leaves it (held by no process)
ENDED = {MARK: b'{"hf_tangent": "run folder", "pid": null, "host": null}\n'}


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


def test_calibrate_rerun_without_the_full_model_leaves_no_model_of_the_first_run(tiny_lm_folder, austen_dir, tmp_path):
    """The issue's case: the second run's report describes other gates, and OUTPUT_DIR/model of the first
    run's gates used to stay beside it (and load)."""
    out = tmp_path / "run"
    evaluation, calibration = _texts(austen_dir, tmp_path)
    common = ["calibrate", "--model", str(tiny_lm_folder), "--text-files", evaluation,
              "--calibration-files", calibration, "--seq-len", "32", "--max-windows", "2",
              "--train-windows", "8", "--per-device-train-batch-size", "4", "--output-dir", str(out)]
    assert cli.main([*common, "--max-steps", "3", "--learning-rate", "0.05", "--save-full-model", "true"]) == 0
    first = json.loads((out / "report.json").read_text())
    assert (out / "model").is_dir() and first["model_folder"]
    assert cli.main([*common, "--max-steps", "2", "--learning-rate", "0.01"]) == 0
    second = json.loads((out / "report.json").read_text())
    assert second["gates"] != first["gates"] and "model_folder" not in second
    assert sorted(p.name for p in out.iterdir()) == [MARK, "gate_profile.png", "loss_curve.png", "patch",
                                                    "report.json", "report.md"]
    card = (out / "patch" / "README.md").read_text()  # the kept patch repo says what made it
    assert f"hf_tangent {ht.__version__}, torch {torch.__version__}" in card
    assert f"Starting weights: blake2b {second['weights']['digest'][:16]}" in card
    patched = ht.from_pretrained(out / "patch")  # the patch left is the second run's, as its report says
    assert {str(c.index): pytest.approx(c.gate.item(), abs=1e-6) for c in ht.tangent_layers(patched)} == second["gates"]


@pytest.mark.slow  # three heal runs (about 30 s); test_a_command_rerun_with_fewer_seeds... covers the folder's part
def test_heal_rerun_with_fewer_seeds_leaves_no_folder_of_the_earlier_seeds(tiny_lm_folder, austen_dir, tmp_path):
    out = tmp_path / "heal"
    evaluation, calibration = _texts(austen_dir, tmp_path)
    common = ["heal", "--model", str(tiny_lm_folder), "--text-files", evaluation,
              "--calibration-files", calibration, "--seq-len", "32", "--max-windows", "2",
              "--train-windows", "4", "--max-steps", "1", "--per-device-train-batch-size", "4", "--update", "projected",
              "--lora-r", "2", "--save-models", "true", "--output-dir", str(out)]
    assert cli.main([*common, "--seeds", "0", "1"]) == 0
    assert (out / "runs" / "seed1" / "patch").is_dir()
    assert cli.main([*common, "--seeds", "0"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["seeds"] == [0] and sorted(p.name for p in (out / "runs").iterdir()) == ["seed0"]
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == [MARK]


def test_a_command_rerun_with_fewer_seeds_leaves_no_folder_of_the_earlier_seeds(tmp_path):
    """What every command runs in (experiments.runs.in_run_folder): a command that writes runs/seed0 and
    its report into a folder where the earlier run wrote runs/seed0 and runs/seed1."""
    import argparse

    from hf_tangent.experiments.runs import in_run_folder

    def command(args):
        (Path(args.output_dir) / "runs" / "seed0" / "patch").mkdir(parents=True)
        _small_report().save(args.output_dir)
        return 0

    out = tmp_path / "heal"
    with RunFolder(out):
        for seed in (0, 1):
            (out / "runs" / f"seed{seed}" / "patch").mkdir(parents=True)
            (out / "runs" / f"seed{seed}" / "patch" / "adapter_config.json").write_text("{}")
    assert in_run_folder(command)(argparse.Namespace(output_dir=str(out))) == 0
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [MARK, "report.json", "report.md", "runs",
                                                                       "runs/seed0", "runs/seed0/patch"]


def _earlier_run(folder: Path) -> dict:
    with RunFolder(folder):
        (folder / "patch").mkdir(parents=True)
        (folder / "patch" / "adapter_config.json").write_text("{}")
        (folder / "runs" / "seed1" / "checkpoint-4").mkdir(parents=True)
        (folder / "runs" / "seed1" / "checkpoint-4" / "trainer_state.json").write_text("{}")
        (folder / "report.json").write_text('{"run": 1}')
        (folder / "old_plot.png").write_bytes(b"png")
    return tree(folder)


def test_a_run_replaces_the_earlier_run_whole_and_a_failed_one_gives_it_back(tmp_path):
    folder = tmp_path / "run"
    before = _earlier_run(folder)
    with pytest.raises(RuntimeError, match="the run failed"), RunFolder(folder):
        assert not [p for p in folder.iterdir() if not p.name.startswith(".")]  # the earlier run is aside
        (folder / "patch").mkdir()
        (folder / "patch" / "partial").write_text("x")
        raise RuntimeError("the run failed")
    assert tree(folder) == before  # given back, byte for byte, and nothing of the failed run
    with RunFolder(folder):
        (folder / "report.json").write_text('{"run": 2}')
    assert tree(folder) == {**ENDED, "report.json": b'{"run": 2}'}


def _stopped_after_a_checkpoint(folder, caplog):
    """A rerun into `folder` stopped by Ctrl-C after its first checkpoint (logged into caplog)."""
    with caplog.at_level(logging.WARNING, logger="hf_tangent"):
        with pytest.raises(KeyboardInterrupt), RunFolder(folder):
            (folder / "checkpoint-2").mkdir()
            (folder / "checkpoint-2" / "trainer_state.json").write_text("{}")
            raise KeyboardInterrupt


def test_a_stopped_run_keeps_its_checkpoint_and_a_resumed_run_continues_it(tmp_path, caplog):
    """Ctrl-C after a checkpoint: the checkpoint stays for --resume_from_checkpoint (logged); a resumed
    run keeps it (the earlier run's files stay aside until it ends); a run that does not resume
    rolls the stopped one back and replaces the earlier run."""
    folder = tmp_path / "run"
    before = _earlier_run(folder)
    _stopped_after_a_checkpoint(folder, caplog)
    assert "--resume_from_checkpoint last continues it" in caplog.text
    assert (folder / "checkpoint-2" / "trainer_state.json").is_file() and not (folder / "report.json").exists()
    with RunFolder(folder, resume=True):
        assert (folder / "checkpoint-2").is_dir() and not (folder / "patch").exists()
        (folder / "report.json").write_text('{"run": 2}')
    assert tree(folder) == {**ENDED, "checkpoint-2": None, "checkpoint-2/trainer_state.json": b"{}",
                            "report.json": b'{"run": 2}'}
    # stopped again, then a fresh run (no resume): the stopped run is rolled back, the earlier one replaced
    with pytest.raises(KeyboardInterrupt), RunFolder(folder):
        (folder / "checkpoint-9").mkdir()
        (folder / "checkpoint-9" / "trainer_state.json").write_text("{}")
        raise KeyboardInterrupt
    assert recover_run_folder(folder) is None and tree(folder) == {
        **ENDED, "checkpoint-2": None, "checkpoint-2/trainer_state.json": b"{}", "report.json": b'{"run": 2}'}
    assert tree(folder) != before


def test_a_report_saved_into_a_folder_of_another_run_replaces_that_run(tmp_path):
    """Report.save into an earlier run's folder is a run of its own: the earlier run's patch, runs and
    plots go (never a loadable artifact the report does not describe); into its own run's folder it
    keeps that run's files."""
    folder = tmp_path / "run"
    _earlier_run(folder)
    _small_report().save(folder)
    assert sorted(p.name for p in folder.iterdir()) == [MARK, "report.json", "report.md"]
    with RunFolder(folder) as own:
        (own / "patch").mkdir()
        (own / "patch" / "adapter_config.json").write_text("{}")
    _small_report(run_folder=own).save(folder)
    assert (folder / "patch" / "adapter_config.json").is_file()


def _small_report(**kwargs) -> Report:
    """An `eval` report (a kind without plots)."""
    rows = [{"variant": "unpatched", "nll": 1.0, "perplexity": 2.718, "delta_nll": 0.0, "delta_perplexity": 0.0,
             "tokens": 10, "config": None}]
    return Report("eval", {"command": "eval", "model": "m", "text": "t", "seq_len": 8, "windows": 1,
                           "tokens_per_variant": 10, "seconds": 0.1, "rows": rows, "unpatched_is": "the model",
                           "device": "cpu", "dtype": "float32", "seed": 0, "threads": 1, "torch": "x",
                           "hf_tangent_version": "x", "python": "x", "peak_rss_gb": 0.1}, **kwargs)


# ----------------------------------------------------------------------------- whose folder it is
def _users_folder(folder: Path) -> dict:
    """Files of the user's that merely have a run's names (review of issue 47, finding 1)."""
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "my_weights.txt").write_text("mine")
    (folder / "runs").mkdir()
    (folder / "runs" / "events").write_text("mine")
    (folder / "README.md").write_text("# my notes")
    (folder / "my_figure.png").write_bytes(b"png")
    return tree(folder)


def test_a_folder_of_the_users_files_with_a_runs_names_is_refused(tiny_lm_folder, tmp_path, capsys):
    """They were claimed by name and deleted (an eval run, Report.save): now a folder is an earlier run's only
    with the mark runs leave (or, from a release before it, a report.json of an hf_tangent command)."""
    folder = tmp_path / "mine"
    before = _users_folder(folder)
    with pytest.raises(DestinationError, match=r"'.*mine' holds README.md, model, my_figure.png, runs, but is not an "
                                               r"hf_tangent run's folder \(no \.hf_tangent-run\.json.*Accepted: a new or "
                                               r"empty folder, or an earlier hf_tangent run's folder"):
        _small_report().save(folder)
    assert cli.main(["eval", "--model", str(tiny_lm_folder), "--output-dir", str(folder), "--max-windows", "1",
                     "--seq-len", "16"]) == 2
    assert "is not an hf_tangent run's folder" in capsys.readouterr().err
    assert tree(folder) == before
    legacy = tmp_path / "legacy"  # a run folder of a release before the mark: its report says so
    (legacy / "patch").mkdir(parents=True)
    (legacy / "report.json").write_text(json.dumps(_small_report().data))
    _small_report().save(legacy)
    assert sorted(p.name for p in legacy.iterdir()) == [MARK, "report.json", "report.md"]


def test_a_folder_a_live_run_holds_is_refused_to_another_process(tmp_path, caplog):
    """A second process saving into a folder whose run is still writing moved that run's files aside and
    deleted them (review finding 2). Here the first run is a forked process inside its RunFolder."""
    import os

    folder = tmp_path / "held"
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the run holding the folder
        try:
            with RunFolder(folder):
                (folder / "checkpoint-5").mkdir(parents=True)
                (folder / "checkpoint-5" / "trainer_state.json").write_text("{}")
                os.write(ready_w, b"x")
                os.read(go_r, 1)
                (folder / "report.json").write_text('{"by": "A"}')
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(go_r)
    try:
        assert os.read(ready_r, 1) == b"x"
        held = tree(folder)
        with pytest.raises(DestinationError, match=f"another run, pid {pid}, is writing into it; accepted: this "
                                                   "folder once that run has ended, or another folder"):
            _small_report().save(folder)
        with caplog.at_level(logging.WARNING, logger="hf_tangent"):
            assert recover_run_folder(folder) is None  # its run is not over: nothing is recovered
        assert f"another run, pid {pid}, is writing into it; nothing recovered" in caplog.text
        assert tree(folder) == held
    finally:
        os.write(go_w, b"x")
        os.waitpid(pid, 0)
    assert tree(folder) == {**ENDED, "checkpoint-5": None, "checkpoint-5/trainer_state.json": b"{}",
                            "report.json": b'{"by": "A"}'}
    _small_report().save(folder)  # ended: the next run replaces it
    assert sorted(p.name for p in folder.iterdir()) == [MARK, "report.json", "report.md"]


def test_an_input_inside_the_output_folder_is_refused_before_anything_moves(tiny_lm_folder, tmp_path, capsys):
    """`eval --model runs/latest/patch --output-dir runs/latest`: the claim moved the folder aside before --model
    was read ("could not load model ... not a local folder"). Now refused, naming both, before anything moves."""
    folder = tmp_path / "latest"
    with RunFolder(folder):
        ht.save_patch(ht.patch(LlamaForCausalLM.from_pretrained(tiny_lm_folder).eval(),
                               ht.TangentConfig(update="projected")), folder / "patch", base_model=str(tiny_lm_folder))
        _small_report(run_folder=folder).save(folder)
    before = tree(folder)
    assert cli.main(["eval", "--model", str(folder / "patch"), "--output-dir", str(folder), "--max-windows", "1",
                     "--seq-len", "16"]) == 2
    assert f"--model {str(folder / 'patch')!r} lies inside the output folder {str(folder)!r}" in capsys.readouterr().err
    assert cli.main(["lm-eval-merge", str(folder / "report.json"), "--output_dir", str(folder)]) == 2
    assert f"a report to merge {str(folder / 'report.json')!r} lies inside" in capsys.readouterr().err
    with pytest.raises(DestinationError, match=r"model= '.*latest/patch' lies inside the output folder"):
        ht.calibrate_gates(str(folder / "patch"), training_args=ht.TangentTrainingArguments(output_dir=str(folder)))
    assert tree(folder) == before


def test_a_run_resumed_from_a_checkpoint_elsewhere_keeps_none_of_the_folders_checkpoints(tmp_path):
    """calibrate --output_dir X --resume_from_checkpoint Y/checkpoint-2 kept run 1's X/checkpoint-4 beside a
    report of 3 steps (review finding 6): only a run that continues the folder's own run keeps them."""
    import argparse

    from hf_tangent.experiments.runs import in_run_folder

    def command(args):
        (Path(args.output_dir) / "checkpoint-3").mkdir()
        (Path(args.output_dir) / "checkpoint-3" / "trainer_state.json").write_text("{}")
        return 0

    other = tmp_path / "Y" / "checkpoint-2"
    other.mkdir(parents=True)
    (other / "trainer_state.json").write_text("{}")
    out = tmp_path / "X"
    with RunFolder(out):
        (out / "checkpoint-4").mkdir(parents=True)
        (out / "checkpoint-4" / "trainer_state.json").write_text("{}")
    assert in_run_folder(command)(argparse.Namespace(output_dir=str(out), resume_from_checkpoint=str(other))) == 0
    assert sorted(p.name for p in out.iterdir()) == [MARK, "checkpoint-3"]
    with RunFolder(out, resume="last"):  # continuing the folder's own run keeps them
        assert (out / "checkpoint-3").is_dir()


def test_a_stopped_run_says_how_to_get_the_earlier_run_back_and_that_works(tmp_path, caplog):
    """After a stopped rerun the earlier run's patch and report were invisible to every loader, with no word
    of where they were (review finding 5): the log names the hidden folder and the call that gives them back."""
    folder = tmp_path / "run"
    before = _earlier_run(folder)
    _stopped_after_a_checkpoint(folder, caplog)
    assert "the earlier run's files in .hf_tangent-run-earlier-" in caplog.text
    call = caplog.text.split('python -c "')[1].split('"')[0]
    assert call == f"from hf_tangent.experiments.runs import recover_run_folder; recover_run_folder({str(folder)!r})"
    exec(call, {})  # the line as a user runs it (in a fresh process it imports hf_tangent: seconds)
    assert tree(folder) == before


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
