"""Issue 57 item 4: the Trainer's and TRL's standard flows on a patched model.

`trainer.train(); trainer.save_model()` writes the patched model into the Trainer's output_dir, beside
`checkpoint-N/` and the Trainer's other entries, which stay byte for byte; a re-save there leaves no file
of the earlier save; `ht.from_pretrained(output_dir)` in a fresh process gives the live model's logits;
`resume_from_checkpoint` restores the gates. A folder of a user's files is still refused, untouched."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from conftest import tiny_smollm2_llama, waits_in_flock
from transformers import Trainer, TrainingArguments

import hf_tangent as ht
from hf_tangent.core import destinations
from hf_tangent.core.destinations import DestinationError

IDS = torch.randint(0, 1000, (8, 16), generator=torch.Generator().manual_seed(0))
TEXT = ["It is a truth universally acknowledged, that a single man in possession of a good fortune",
        "must be in want of a wife. However little known the feelings or views of such a man may be"] * 4
CHECKPOINT_FILES = ("model.safetensors", "config.json", "optimizer.pt", "scheduler.pt", "trainer_state.json")


def patched():
    model, tokenizer = tiny_smollm2_llama()
    return ht.patch(model, ht.TangentConfig(update="projected", gates=True)), tokenizer


def gates(model) -> list[float]:
    return [float(child.gate.detach()) for child in ht.tangent_layers(model)]


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(IDS).logits


def hashes(folder: Path) -> dict[str, str]:
    """Every file below `folder` (relative path -> sha256)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def logits_in_a_fresh_process(folder: Path, tmp_path: Path) -> torch.Tensor:
    io = tmp_path / "io.pt"
    torch.save(IDS, io)
    code = ("import sys, torch, hf_tangent as ht\n"
            "model = ht.from_pretrained(sys.argv[1]).eval()\n"
            "with torch.no_grad():\n    torch.save(model(torch.load(sys.argv[2])).logits, sys.argv[2])\n")
    result = subprocess.run([sys.executable, "-c", code, str(folder), str(io)], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(io)


def trainer(model, tokenizer, output_dir, *, max_steps=2, **fields):
    args = TrainingArguments(str(output_dir), max_steps=max_steps, save_steps=1, per_device_train_batch_size=4,
                             learning_rate=5e-2, lr_scheduler_type="constant", report_to=[], use_cpu=True,
                             logging_steps=1, **fields)
    rows = IDS.tolist()
    return Trainer(model=model, args=args, processing_class=tokenizer,
                   train_dataset=datasets.Dataset.from_dict({"input_ids": rows, "labels": rows}))


def sft_trainer(model, tokenizer, output_dir, *, max_steps=2):
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(str(output_dir), max_steps=max_steps, save_steps=1, per_device_train_batch_size=4,
                     learning_rate=5e-2, lr_scheduler_type="constant", report_to=[], use_cpu=True, bf16=False,
                     max_length=16, logging_steps=1)
    return SFTTrainer(model=model, args=args, processing_class=tokenizer,
                      train_dataset=datasets.Dataset.from_dict({"text": TEXT}))


def model_files(model, tmp_path: Path) -> dict[str, str]:
    """What a save of `model` into a new folder holds (name -> sha256)."""
    model.save_pretrained(tmp_path / "alone")
    return hashes(tmp_path / "alone")


def save_model_extras(tokenizer, tmp_path: Path) -> set[str]:
    """What Trainer.save_model writes besides the model's save: the tokenizer's files and the arguments."""
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    return {p.name for p in (tmp_path / "tokenizer").iterdir()} | {"training_args.bin"}


# ----------------------------------------------------------------------------- the Trainer
def test_trainer_save_model_writes_beside_the_checkpoints_and_loads_exactly(tmp_path):
    """Before issue 57 the first save_model() was refused: 'non-empty folder that hf_tangent did not write
    (it holds checkpoint-1/, checkpoint-2/)'."""
    model, tokenizer = patched()
    out = tmp_path / "out"
    run = trainer(model, tokenizer, out)
    result = run.train()
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-1", "checkpoint-2"]
    assert all((out / "checkpoint-2" / name).is_file() for name in CHECKPOINT_FILES)
    before = hashes(out)
    run.save_model()
    run.save_state()
    run.save_metrics("train", result.metrics)  # train_results.json, all_results.json
    run.create_model_card()  # README.md
    own = model_files(model, tmp_path)
    after = hashes(out)
    assert {k: v for k, v in after.items() if k.startswith("checkpoint-")} == before  # byte for byte
    assert {name: after[name] for name in own} == own  # the patched model's files, as a save of its own
    trainers = {"trainer_state.json", "all_results.json", "train_results.json", "README.md"}
    assert set(after) == set(before) | set(own) | trainers | save_model_extras(tokenizer, tmp_path)
    assert torch.equal(logits_in_a_fresh_process(out, tmp_path), logits(model))


def test_a_resave_into_the_output_dir_leaves_no_stale_file_and_touches_nothing_else(tmp_path):
    """An earlier save sharded (an index and shards), then save_model(output_dir): the shards and index go (a
    stale index would be read first), every entry of the Trainer's stays as it was."""
    model, tokenizer = patched()
    out = tmp_path / "out"
    run = trainer(model, tokenizer, out)
    run.train()
    run.save_state()
    model.save_pretrained(out, max_shard_size="20KB")
    assert len([p for p in out.iterdir() if destinations._SHARD.fullmatch(p.name)]) > 1
    theirs = {k: v for k, v in hashes(out).items() if k.startswith("checkpoint-") or k == "trainer_state.json"}
    with torch.no_grad():
        for child in ht.tangent_layers(model):
            child.gate.fill_(0.25 + child.index)  # a different model, so an old file left would show
    run.save_model(str(out))
    own = model_files(model, tmp_path)
    after = hashes(out)
    assert {k: after[k] for k in theirs} == theirs
    assert set(after) == set(theirs) | set(own) | save_model_extras(tokenizer, tmp_path)
    assert {name: after[name] for name in own} == own
    assert torch.equal(logits_in_a_fresh_process(out, tmp_path), logits(model))


def test_resume_from_checkpoint_restores_the_gates(tmp_path):
    """A run of 3 steps equals one of 2 steps (saved, then save_model into its output_dir) resumed with
    resume_from_checkpoint=True by a fresh patched model whose gates start at 1.0."""
    whole, tokenizer = patched()
    trainer(whole, tokenizer, tmp_path / "whole", max_steps=3).train()
    first, _ = patched()
    run = trainer(first, tokenizer, tmp_path / "out")
    run.train()
    run.save_model()
    resumed, _ = patched()
    assert gates(resumed) == [1.0, 1.0] != gates(first)
    trainer(resumed, tokenizer, tmp_path / "out", max_steps=3).train(resume_from_checkpoint=True)
    assert gates(resumed) == gates(whole) != gates(first)
    assert ht.get_config(resumed) == ht.get_config(whole)
    assert torch.equal(logits(resumed), logits(whole))


# ----------------------------------------------------------------------------- TRL
def test_sft_trainer_save_model_and_resume(tmp_path):
    """TRL's SFTTrainer saves checkpoints by default and writes its card into output_dir at each one."""
    model, tokenizer = patched()
    out = tmp_path / "out"
    run = sft_trainer(model, tokenizer, out)
    run.train()
    assert {"README.md", "checkpoint-1", "checkpoint-2"} <= {p.name for p in out.iterdir()}
    before = hashes(out)
    run.save_model()
    run.save_model()  # again: the same files, nothing left over
    own = model_files(model, tmp_path)
    after = hashes(out)
    assert {k: after[k] for k in before} == before
    assert {name: after[name] for name in own} == own
    assert set(after) == set(before) | set(own) | save_model_extras(tokenizer, tmp_path)
    assert torch.equal(logits_in_a_fresh_process(out, tmp_path), logits(model))

    resumed, _ = patched()
    sft_trainer(resumed, tokenizer, out).train(resume_from_checkpoint=True)  # at step 2 already: loads only
    assert gates(resumed) == gates(model) != [1.0, 1.0]
    assert torch.equal(logits(resumed), logits(model))


# ----------------------------------------------------------------------------- what is still refused
def test_a_folder_of_user_files_beside_checkpoints_is_refused_and_untouched(tmp_path):
    model, _ = patched()
    for name, extra in (("notes", "notes.txt"), ("plain", "model.safetensors")):
        folder = tmp_path / name
        (folder / "checkpoint-1").mkdir(parents=True)
        (folder / "checkpoint-1" / "model.safetensors").write_bytes(b"x")
        (folder / "runs").mkdir()
        (folder / "all_results.json").write_text("{}")
        (folder / extra).write_text("mine")
        before = hashes(folder)
        with pytest.raises(DestinationError, match=rf"non-empty folder that hf_tangent did not write \(it holds {extra}\)"):
            model.save_pretrained(folder)
        assert hashes(folder) == before and sorted(p.name for p in folder.iterdir()) == sorted(
            ["checkpoint-1", "runs", "all_results.json", extra])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "plain"]  # no staging folder left


def test_a_failed_move_leaves_the_earlier_save_as_it_was(tmp_path, monkeypatch):
    """The record goes first and comes last; a save of another model that fails at its last move (the new
    record's) puts the earlier save back byte for byte (it loaded as before), Trainer entries untouched."""
    model, _ = patched()
    out = tmp_path / "out"
    (out / "checkpoint-1").mkdir(parents=True)
    (out / "checkpoint-1" / "trainer_state.json").write_text("{}")
    model.save_pretrained(out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    real, moved = os.replace, []

    def flaky(src, dst):
        moved.append(Path(dst).name)
        if Path(dst).name == "config.json" and Path(dst).parent == out and ".hf_tangent-earlier-" not in str(src):
            raise OSError("injected failure")
        return real(src, dst)

    monkeypatch.setattr(destinations.os, "replace", flaky)
    with pytest.raises(OSError, match="injected failure"):
        ht.patch(tiny_smollm2_llama(layers=3)[0], ht.TangentConfig(update="retract")).save_pretrained(out)
    monkeypatch.setattr(destinations.os, "replace", real)
    assert "model.safetensors" in moved and "config.json" in moved
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no stage, no aside folder left
    with torch.no_grad():
        ids = torch.tensor([[1, 5, 9, 2]])
        assert torch.equal(ht.from_pretrained(out)(ids).logits, model(ids).logits)


def test_two_saves_into_one_output_dir_at_once_are_one_after_the_other(tmp_path, monkeypatch):
    """A save of a patched folder pauses while it moves its files in; a patch repo saved into the same output_dir
    meanwhile waits for it (the target's lock), then replaces it: the folder is the patch repo alone. Without the
    lock both went in and the folder held the two saves mixed (the patched folder's config and weights beside the
    repo's record)."""
    import threading

    out = tmp_path / "out"
    (out / "checkpoint-1").mkdir(parents=True)
    folder_model, _ = patched()
    tiny_smollm2_llama(layers=3)[0].save_pretrained(tmp_path / "base")
    from transformers import LlamaForCausalLM

    repo_model = ht.patch(LlamaForCausalLM.from_pretrained(tmp_path / "base"), ht.TangentConfig(update="retract"))
    paused, resume, errors = threading.Event(), threading.Event(), []
    real = destinations._move_in

    def slow(*args, **kwargs):
        if threading.current_thread().name == "folder":
            paused.set()
            resume.wait(60)
        return real(*args, **kwargs)

    def run(save):
        try:
            save()
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    monkeypatch.setattr(destinations, "_move_in", slow)
    first = threading.Thread(target=run, args=(lambda: folder_model.save_pretrained(out),), name="folder")
    second = threading.Thread(target=run, args=(lambda: ht.save_patch(repo_model, out),), name="repo")
    first.start()
    assert paused.wait(60)
    second.start()
    waited = waits_in_flock(second)  # for the folder's lock (without it the save finishes instead)
    resume.set()
    first.join(60)
    second.join(60)
    assert errors == [] and waited
    assert destinations.artifact_kind(out) == "patch repo" and not (out / "config.json").exists()
    assert not (out / "model.safetensors").exists() and (out / "checkpoint-1").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "out"]
    assert torch.equal(logits(ht.from_pretrained(out)), logits(repo_model))


def test_a_killed_checkpoint_saves_stage_in_the_output_dir_does_not_block_the_next_save(tmp_path):
    """A checkpoint save killed inside the output_dir leaves its stage there (.checkpoint-3.hf_tangent-ready-ID):
    the next save into the output_dir goes on (it was refused as a folder 'hf_tangent did not write') and leaves
    that stage to checkpoint-3's own recovery, which finishes it."""
    model, _ = patched()
    out = tmp_path / "out"
    (out / "checkpoint-1").mkdir(parents=True)
    stage = out / ".checkpoint-3.hf_tangent-ready-0123abcd"
    stage.mkdir()
    (stage / "trainer_state.json").write_text("{}")
    model.save_pretrained(out)
    model.save_pretrained(out)  # and again, over the first save
    assert stage.is_dir() and destinations.artifact_kind(out) == "patched folder"
    destinations.recover(out / "checkpoint-3")
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
    assert (out / "checkpoint-3" / "trainer_state.json").read_text() == "{}"
    assert torch.equal(logits(ht.from_pretrained(out)), logits(model))
