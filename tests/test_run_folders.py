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
from hf_tangent.experiments.report import Report
from hf_tangent.experiments.runs import RunFolder, recover_run_folder


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
    assert sorted(p.name for p in out.iterdir()) == ["gate_profile.png", "loss_curve.png", "patch", "report.json",
                                                    "report.md"]
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
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


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
    for seed in (0, 1):
        (out / "runs" / f"seed{seed}" / "patch").mkdir(parents=True)
        (out / "runs" / f"seed{seed}" / "patch" / "hf_tangent_patch.json").write_text("{}")
    assert in_run_folder(command)(argparse.Namespace(output_dir=str(out))) == 0
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == ["report.json", "report.md", "runs", "runs/seed0",
                                                                       "runs/seed0/patch"]


def _earlier_run(folder: Path) -> dict:
    (folder / "patch").mkdir(parents=True)
    (folder / "patch" / "hf_tangent_patch.json").write_text("{}")
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
    assert tree(folder) == {"report.json": b'{"run": 2}'}


def test_a_stopped_run_keeps_its_checkpoint_and_a_resumed_run_continues_it(tmp_path, caplog):
    """Ctrl-C after a checkpoint: the checkpoint stays for --resume_from_checkpoint (logged); a resumed
    run keeps it (the earlier run's files stay aside until it ends); a run that does not resume
    rolls the stopped one back and replaces the earlier run."""
    folder = tmp_path / "run"
    before = _earlier_run(folder)
    with caplog.at_level(logging.WARNING, logger="hf_tangent"):
        with pytest.raises(KeyboardInterrupt), RunFolder(folder):
            (folder / "checkpoint-2").mkdir()
            (folder / "checkpoint-2" / "trainer_state.json").write_text("{}")
            raise KeyboardInterrupt
    assert "--resume_from_checkpoint last continues it" in caplog.text
    assert (folder / "checkpoint-2" / "trainer_state.json").is_file() and not (folder / "report.json").exists()
    with RunFolder(folder, resume=True):
        assert (folder / "checkpoint-2").is_dir() and not (folder / "patch").exists()
        (folder / "report.json").write_text('{"run": 2}')
    assert tree(folder) == {"checkpoint-2": None, "checkpoint-2/trainer_state.json": b"{}", "report.json": b'{"run": 2}'}
    # stopped again, then a fresh run (no resume): the stopped run is rolled back, the earlier one replaced
    with pytest.raises(KeyboardInterrupt), RunFolder(folder):
        (folder / "checkpoint-9").mkdir()
        (folder / "checkpoint-9" / "trainer_state.json").write_text("{}")
        raise KeyboardInterrupt
    assert recover_run_folder(folder) is None and tree(folder) == {
        "checkpoint-2": None, "checkpoint-2/trainer_state.json": b"{}", "report.json": b'{"run": 2}'}
    assert tree(folder) != before


def test_a_report_saved_into_a_folder_of_another_run_replaces_that_run(tmp_path):
    """Report.save into an earlier run's folder is a run of its own: the earlier run's patch, runs and
    plots go (never a loadable artifact the report does not describe); into its own run's folder it
    keeps that run's files."""
    folder = tmp_path / "run"
    _earlier_run(folder)
    _small_report().save(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["report.json", "report.md"]
    with RunFolder(folder) as own:
        (own / "patch").mkdir()
        (own / "patch" / "hf_tangent_patch.json").write_text("{}")
    _small_report(run_folder=own).save(folder)
    assert (folder / "patch" / "hf_tangent_patch.json").is_file()


def _small_report(**kwargs) -> Report:
    """An `eval` report (a kind without plots)."""
    rows = [{"variant": "unpatched", "nll": 1.0, "perplexity": 2.718, "delta_nll": 0.0, "delta_perplexity": 0.0,
             "tokens": 10, "config": None}]
    return Report("eval", {"command": "eval", "model": "m", "text": "t", "seq_len": 8, "windows": 1,
                           "tokens_per_variant": 10, "seconds": 0.1, "rows": rows, "unpatched_is": "the model",
                           "device": "cpu", "dtype": "float32", "seed": 0, "threads": 1, "torch": "x",
                           "hf_tangent_version": "x", "python": "x", "peak_rss_gb": 0.1}, **kwargs)


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
