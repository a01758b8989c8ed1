"""Issue 47: every report records what produced it (the library versions, a digest of the weights it
scored, the text's digests and, for the offline corpus, the Debian package versions), `lm-eval-merge`
refuses parts of other weights or software naming both, and the small defects of the fifth probe:
each checked against an independent computation or by message, each pinned by a case that failed before."""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
import transformers
from transformers import LlamaForCausalLM

import hf_tangent as ht
from hf_tangent.experiments.report import Report


def blake2b_of_parameters(model) -> str:
    """The digest written out independently: every parameter's name, dtype, shape and raw bytes, then the patch
    record (None: not patched) and the config fields that change the computation, as sorted JSON."""
    from hf_tangent.artifacts.identity import computation_config

    digest = hashlib.blake2b(digest_size=32)
    for name, param in model.named_parameters():
        digest.update(f"{name}:{param.dtype}:{tuple(param.shape)};".encode())
        digest.update(param.detach().contiguous().numpy().tobytes())
    digest.update(json.dumps({"patch": getattr(model.config, "hf_tangent", None),
                              "config": computation_config(model.config)}, sort_keys=True).encode())
    return digest.hexdigest()


def test_an_eval_report_records_versions_weights_and_text(tiny_lm_folder, austen_dir, tmp_path):
    text = tmp_path / "emma.txt"
    text.write_text((austen_dir / "emma.txt").read_text(encoding="utf-8")[:6000], encoding="utf-8")
    model = LlamaForCausalLM.from_pretrained(tiny_lm_folder).eval()
    report = ht.evaluate_rules(str(tiny_lm_folder), text=ht.TextSource(text_files=(str(text),)), rules=["projected"],
                               seq_len=16, max_windows=2, progress=False)
    versions = report["versions"]
    assert versions["torch"] == torch.__version__ and versions["transformers"] == transformers.__version__
    assert versions["hf_tangent"] == ht.__version__ and versions["lm_eval"] == importlib.metadata.version("lm_eval")
    assert set(versions) >= {"vllm", "peft", "datasets", "accelerate", "safetensors"}
    assert report["weights"]["digest"] == blake2b_of_parameters(model)
    assert report["weights"]["parameters"] == sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        model.model.embed_tokens.weight[7, 3] += 1e-6  # one value: another digest
    assert blake2b_of_parameters(model) != report["weights"]["digest"]
    expected = hashlib.sha256(text.read_text(encoding="utf-8").encode() + b"\0").hexdigest()
    assert report["text_provenance"]["evaluation"] == {
        "text": {"documents": 1, "characters": len(text.read_text(encoding="utf-8")), "sha256": expected}}
    assert report["text_provenance"]["packages"] == {}  # the user's own file: no package


def test_the_mixed_corpus_records_each_domains_package_version(tmp_path, monkeypatch):
    """The issue's case: a mixed-corpus report said "corpus": "mixed" and not which package versions the text
    came from. A corpus folder built with versions records them per domain (sources.json), Austen's from
    the source.json written beside the novels."""
    from conftest import AUSTEN, CORPUS_EXCERPTS

    from hf_tangent.training.corpora import DOMAINS, debian

    corpus = tmp_path / "corpus"
    versions = {d.package: f"1.{k}-2" for k, d in enumerate(DOMAINS.values()) if d.package}
    debian.build_corpus(CORPUS_EXCERPTS, corpus, versions, debian.Sizes(document_words=300, min_document_words=50,
                                                                        heldout_min_words=0, heldout_max_words=10**9,
                                                                        train_max_words=10**9))
    novels = tmp_path / "austen"
    novels.mkdir()
    for path in AUSTEN.glob("*.txt"):
        (novels / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    (novels / "source.json").write_text(json.dumps({"package": "r-cran-janeaustenr", "version": "0.1.5-1"}))
    monkeypatch.setenv("HF_TANGENT_CORPUS_DIR", str(corpus))
    monkeypatch.setenv("HF_TANGENT_AUSTEN_DIR", str(novels))
    found = ht.TextSource(corpus="mixed").provenance(training=True)
    assert found["packages"]["austen"] == {"package": "r-cran-janeaustenr", "version": "0.1.5-1"}
    for name, domain in DOMAINS.items():
        if name != "austen":
            assert found["packages"][name] == {"package": domain.package, "version": versions[domain.package]}
    heldout = sorted((corpus / "jargon" / "heldout").glob("*.txt"))
    digest = hashlib.sha256()
    for path in heldout:
        digest.update(path.read_text(encoding="utf-8").encode() + b"\0")
    assert found["evaluation"]["jargon"] == {"documents": len(heldout), "sha256": digest.hexdigest(),
                                             "characters": sum(len(p.read_text(encoding="utf-8")) for p in heldout)}
    assert set(found["training"]) == set(DOMAINS)


# ----------------------------------------------------------------------------- lm-eval-merge
@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    pytest.importorskip("lm_eval")
    from conftest import tiny_smollm2_llama

    folders = []
    for seed in (0, 1):
        folder = tmp_path_factory.mktemp(f"random{seed}")
        model, tokenizer = tiny_smollm2_llama(max_positions=1024)
        torch.manual_seed(seed)
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0, 0.2)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        folders.append(folder)
    return folders


def _part(folder, task):
    return ht.lm_eval(str(folder), tasks=[task], variants=["unpatched"], limit=2, bootstrap=10)


@pytest.fixture(scope="module")
def parts(two_models):
    """a: model 0 on one task; b: model 1 (other weights) on another; same: model 0 on b's task."""
    return {"a": _part(two_models[0], "austen_lastword"), "b": _part(two_models[1], "austen_nextsentence"),
            "same": _part(two_models[0], "austen_nextsentence")}


def test_merge_refuses_parts_scored_on_other_weights_naming_both(parts, tmp_path):
    """The issue's case: two random models under the same name, one task each, merged without a word."""
    from hf_tangent import cli

    a, b, same = parts["a"], Report("lm-eval", copy.deepcopy(parts["b"].data)), parts["same"]
    b.data["model"] = a.data["model"]  # the same name, other weights
    a.save(tmp_path / "a")
    b.save(tmp_path / "b")
    with pytest.raises(ValueError, match=r"the parts scored different weights: part 1 \(a Report object\) "
                                         r"[0-9a-f]{16}\.\.\. .* and part 2 \(a Report object\) [0-9a-f]{16}"):
        ht.merge_lm_eval([a, b])
    assert cli.main(["lm-eval-merge", str(tmp_path / "a"), str(tmp_path / "b"), "--output_dir",
                     str(tmp_path / "merged")]) == 2
    assert not (tmp_path / "merged").exists()
    merged = ht.merge_lm_eval([a, same])  # the same weights: merged, with the provenance kept
    assert merged["weights"] == a["weights"] and merged["versions"] == a["versions"]
    assert merged["task_files"] == a["task_files"] | same["task_files"]
    other = Report("lm-eval", copy.deepcopy(same.data))
    other.data["versions"]["transformers"] = "4.0.0"
    with pytest.raises(ValueError, match=rf"transformers {transformers.__version__} in part 1 \(a Report object\) "
                                         r"and 4.0.0 in part 2"):
        ht.merge_lm_eval([a, other])
    older = Report("lm-eval", {k: v for k, v in same.data.items() if k != "weights"})
    with pytest.raises(ValueError, match="part 2 .* records no weights .* rerun that part"):
        ht.merge_lm_eval([a, older])
    files = Report("lm-eval", copy.deepcopy(same.data))
    files.data["task_files"]["austen_nextsentence"] = "0" * 64
    files.data["seconds"] += 1
    with pytest.raises(ValueError, match="the task 'austen_nextsentence' differs between"):
        ht.merge_lm_eval([a, same, files])


def test_merge_refuses_one_base_patched_two_ways_naming_the_difference(parts):
    """Review of issue 47: the weights digest covered the parameters only, so the same base patched with
    update="projected" and with update="add" (other logits) gave one digest, and lm-eval-merge joined parts of
    the two patches without a word. The digest now covers the patch record and the config's computation
    fields, and the refusal names the field that differs; the same patch merges."""
    from conftest import tiny_smollm2_llama

    from hf_tangent.artifacts.identity import scored_weights

    model, _ = tiny_smollm2_llama()
    projected = scored_weights(ht.patch(model, ht.TangentConfig(update="projected")))
    ht.unpatch(model)
    added = scored_weights(ht.patch(model, ht.TangentConfig(update="add", layers=[1])))
    assert projected["digest"] != added["digest"] and projected["patch"]["config"]["update"] == "projected"
    assert projected["digest"] == blake2b_of_parameters(ht.patch(tiny_smollm2_llama()[0],
                                                                 ht.TangentConfig(update="projected")))
    a, b = Report("lm-eval", copy.deepcopy(parts["a"].data)), Report("lm-eval", copy.deepcopy(parts["same"].data))
    a.data["weights"], b.data["weights"] = projected, added
    with pytest.raises(ValueError, match=r"the parts scored different weights: .*; the patch differs: config.layers "
                                         r"None in part 1 \(a Report object\) and \[1\] in part 2 \(a Report "
                                         r"object\); config.update 'projected' in part 1 \(a Report object\) and "
                                         r"'add' in part 2"):
        ht.merge_lm_eval([a, b])
    b.data["weights"] = copy.deepcopy(projected)  # the same patch of the same base: one measurement
    assert ht.merge_lm_eval([a, b])["weights"] == projected
    a.data["variant_weights"], b.data["variant_weights"] = {"healed": projected}, {"healed": added}
    with pytest.raises(ValueError, match=r"the saved folder 'healed' differs between part 1 .*; the patch differs: "
                                         r"config.layers None in part 1"):
        ht.merge_lm_eval([a, b])


@pytest.mark.parametrize("field, value, message", [
    ("weights", {"digest": 5}, "weights.digest is 5, not 64 hex digits"),
    ("weights", "abc", "weights is str, not an object"),
    ("versions", {"torch": 2}, "versions is {'torch': 2}, not an object of library -> version string"),
    ("variant_weights", {"f": "x"}, "variant_weights['f'] is str, not an object"),
    ("task_files", {"austen_lastword": 7}, "task_files['austen_lastword'] is 7, not 64 hex digits")])
def test_malformed_provenance_is_refused_by_its_readers(parts, tmp_path, field, value, message):
    """Review of issue 47: Report.load accepted {"weights": {"digest": 5}} and lm-eval-merge then ended in a
    TypeError (digest[:16] of an int); both now refuse it naming the field and value."""
    parts["a"].save(tmp_path / "a")
    data = json.loads((tmp_path / "a" / "report.json").read_text(encoding="utf-8"))
    data[field] = value
    (tmp_path / "a" / "report.json").write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ValueError, match=rf"report.json: a damaged 'lm-eval' report: its provenance is malformed "
                                         rf"\(.*{re.escape(message)}"):
        Report.load(tmp_path / "a" / "report.json")
    with pytest.raises(ValueError, match=rf"merge_lm_eval: part 2 \(a Report object\) has malformed provenance "
                                         rf"\(.*{re.escape(message)}"):
        ht.merge_lm_eval([parts["same"], Report("lm-eval", data)])


# ----------------------------------------------------------------------------- the small defects
def read_only(folder: Path):
    """Make `folder` unwritable for this process (root writes anywhere but into an immutable folder: chattr
    +i); returns the function that undoes it."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return lambda: folder.chmod(0o755)
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("root here cannot make a folder unwritable (no chattr +i on this filesystem)")
    return lambda: subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_lm_eval_merge_into_a_folder_it_cannot_write_says_so(parts, tmp_path, capsys):
    """Was a PermissionError traceback from PIL; the other commands say "not writable"."""
    from hf_tangent import cli

    parts["a"].save(tmp_path / "a")
    parts["same"].save(tmp_path / "b")
    locked = tmp_path / "locked"
    locked.mkdir()
    undo = read_only(locked)
    try:
        code = cli.main(["lm-eval-merge", str(tmp_path / "a"), str(tmp_path / "b"), "--output_dir", str(locked)])
    finally:
        undo()
    assert code == 2
    assert f"error: --output-dir: '{locked}' is not writable" in capsys.readouterr().err
    assert list(locked.iterdir()) == []


def test_save_patch_refuses_a_base_name_its_reader_would_refuse(tiny_lm_folder, tmp_path):
    """save_patch(..., base_model=123) wrote a repo that the package's own reader refused."""
    model = ht.patch(LlamaForCausalLM.from_pretrained(tiny_lm_folder), ht.TangentConfig(update="projected", gates=True))
    for value, option in ((123, "base_model=123"), ("", "base_model=''"), (b"x", "base_model=b'x'")):
        with pytest.raises(TypeError, match=rf"{option}; accepted: a hub id, a local folder or an offline name"):
            ht.save_patch(model, tmp_path / "patch", base_model=value)
    with pytest.raises(TypeError, match="revision=5; accepted: a revision string"):
        ht.save_patch(model, tmp_path / "patch", revision=5)
    assert not (tmp_path / "patch").exists() and not list(tmp_path.iterdir())
    folder = ht.save_patch(model, tmp_path / "patch", base_model=Path(tiny_lm_folder))  # a PathLike: recorded as str
    assert ht.get_config(ht.from_pretrained(folder)).update == "projected"


def test_heal_refuses_a_temperature_whose_loss_overflows(tiny_lm_folder):
    """heal --temperature 1e308 ran and wrote NaN into the report (T^2 = inf)."""
    from hf_tangent import cli
    from hf_tangent.experiments.heal import HealSettings

    with pytest.raises(ValueError, match=r"temperature=1e\+308 is out of range; accepted: a number > 0 and <= 100"):
        HealSettings(temperature=1e308)
    assert cli.main(["heal", "--model", str(tiny_lm_folder), "--temperature", "1e308"]) == 2
    assert HealSettings(temperature=100.0).temperature == 100.0


@pytest.mark.parametrize("recipe", ["calibrate", pytest.param("finetune", marks=pytest.mark.slow)])  # two runs: 7 s
def test_a_training_report_records_the_text_it_read_not_the_files_at_its_end(recipe, tiny_lm_folder, tmp_path,
                                                                            monkeypatch):
    """calibrate and finetune read their text files again when the report was made (review finding 8): text
    changed during training was recorded as if trained on, and a text that had become one document lost the
    finished run ("training needs ... two documents"). The report records what was read."""
    import importlib

    from hf_tangent.training.data import documents_digest

    files = [tmp_path / f"doc{i}.txt" for i in range(2)]
    docs = [f"Document {i}. " + "It is a truth universally acknowledged, said Emma. " * 20 for i in range(2)]
    for path, doc in zip(files, docs, strict=True):
        path.write_text(doc, encoding="utf-8")
    module = importlib.import_module(f"hf_tangent.experiments.{recipe}")  # (the package's `finetune` is the function)
    real = module.train

    def train_then_change_the_files(*args, **kwargs):
        trainer = real(*args, **kwargs)
        files[0].write_text("COMPLETELY DIFFERENT. " * 40, encoding="utf-8")
        files[1].write_text("", encoding="utf-8")  # now one document: re-reading it raises
        return trainer

    monkeypatch.setattr(module, "train", train_then_change_the_files)
    text = ht.TextSource(text_files=tuple(str(f) for f in files))
    common = dict(text=text, seq_len=16, max_windows=1, train_windows=2)
    out = str(tmp_path / "out")
    if recipe == "calibrate":
        report = ht.calibrate_gates(str(tiny_lm_folder), training_args=ht.TangentTrainingArguments(
            output_dir=out, max_steps=1, per_device_train_batch_size=1, report_to=[]), progress=False, **common)
    else:
        report = ht.finetune(str(tiny_lm_folder), rules=["projected"], seeds=[0], lora=ht.LoraSettings(r=2),
                             training_args=module.FinetuneTrainingArguments(output_dir=out, max_steps=1,
                                                                            per_device_train_batch_size=1, report_to=[]),
                             **common)
    assert report["text_provenance"]["evaluation"] == documents_digest({"text": docs[1:]})  # the last 20 %
    assert report["text_provenance"]["training"] == documents_digest({"text": docs[:1]})


def test_the_lm_eval_task_files_are_replaced_in_one_rename(tmp_path, monkeypatch):
    """task_folder rewrote the shared task YAML cache with a plain write (review finding 14): a process
    reading it meanwhile, or a write that failed halfway, saw a truncated task. Now a failed write
    leaves the earlier file whole and nothing else."""
    from hf_tangent.integrations.harness import tasks

    folder = tmp_path / "lm_eval_tasks"
    folder.mkdir()
    (folder / "austen_lastword.yaml").write_text("task: austen_lastword  # an earlier venv's data path\n")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    original = Path.write_text

    def half_then_fail(self, data, *args, **kwargs):
        original(self, data[: len(data) // 2], *args, **kwargs)
        raise OSError("disk full")

    monkeypatch.setattr(Path, "write_text", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        tasks.task_folder(folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    monkeypatch.undo()
    assert sorted(p.name for p in tasks.task_folder(folder).iterdir()) == [f"{t}.yaml" for t in tasks.TASKS]
