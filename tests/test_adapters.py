"""Patch repos (hf_tangent/artifacts/patch_repo.py): kilobytes that point at their base, a PEFT adapter folder. Round
trips in a fresh process against a local base folder standing in for the Hub; mismatches and damaged files
are one clear error; PEFT's own loaders refuse a repo with LoRA adapters or read them where told to; the
format hf_tangent 0.3 and 0.4 wrote (hf_tangent_patch.json + gates.safetensors) still loads."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import as_format_2 as legacy
from transformers import LlamaConfig, LlamaForCausalLM

import hf_tangent as ht
from hf_tangent.artifacts.patch_repo import PatchRepoError, read_record

IDS = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))


def base(folder):
    return LlamaForCausalLM.from_pretrained(folder).eval()


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def fresh_process_logits(patch_folder, tmp_path, **kwargs) -> torch.Tensor:
    """ht.from_pretrained(patch_folder) in a new process: the logits it gives."""
    out = tmp_path / "fresh.pt"
    script = textwrap.dedent(f"""
        import torch, hf_tangent as ht
        model = ht.from_pretrained({str(patch_folder)!r}, **{kwargs!r}).eval()
        with torch.no_grad():
            torch.save(model(torch.load({str(tmp_path / 'ids.pt')!r})).logits, {str(out)!r})
    """)
    torch.save(IDS, tmp_path / "ids.pt")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out)


def gated(folder, **fields):
    model = ht.patch(base(folder), ht.TangentConfig(update="projected", gates=True, **fields))
    with torch.no_grad():
        for child in ht.tangent_layers(model):
            child.gate.fill_(0.5 + 0.375 * child.index)
    return model


def test_gates_only_patch_repo_is_kilobytes_and_reloads_identically(tiny_lm_folder, tmp_path):
    model = gated(tiny_lm_folder)
    folder = ht.save_patch(model, tmp_path / "patch", card={"results": "Delta L = -0.01 (example)"})
    files = sorted(p.name for p in folder.iterdir())
    assert files == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    assert sum(p.stat().st_size for p in folder.iterdir()) < 100_000
    record = read_record(folder)
    assert record["base"]["name_or_path"] == str(tiny_lm_folder) and record["base"]["source"] == "local"
    assert record["patch"]["config"]["update"] == "projected" and record["adapters"] is None
    assert torch.equal(fresh_process_logits(folder, tmp_path), logits(model))
    card = (folder / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: hf_tangent") and "Delta L = -0.01" in card
    assert torch.equal(fresh_process_logits(legacy(folder), tmp_path), logits(model))  # format 2 still loads


@pytest.mark.parametrize("kind", ["homotopy", "parallel"])
def test_homotopy_and_parallel_patches_round_trip(tiny_lm_folder, tmp_path, kind):
    if kind == "homotopy":
        model = ht.set_homotopy(gated(tiny_lm_folder), {0: 0.25, 1: 0.75})
    else:
        model = ht.patch(base(tiny_lm_folder), ht.TangentConfig(update="retract", p=2.0, parallel_layers=[1]))
    folder = ht.save_patch(model, tmp_path / "patch")
    assert torch.equal(fresh_process_logits(folder, tmp_path), logits(model))
    reloaded = ht.from_pretrained(folder)
    assert ht.get_homotopy(reloaded) == ht.get_homotopy(model)
    assert ht.get_config(reloaded).parallel_layers == ht.get_config(model).parallel_layers
    from peft import PeftModel  # PEFT's loader sets the same homotopy

    assert ht.get_homotopy(PeftModel.from_pretrained(base(tiny_lm_folder), folder)) == ht.get_homotopy(model)


def _healed(folder):
    from peft import LoraConfig, get_peft_model

    patched = ht.patch(base(folder), ht.TangentConfig(update="norm_preserving"))
    return get_peft_model(patched, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                              init_lora_weights=False))  # non-zero adapters: they change the logits


def test_lora_healed_patch_repo_round_trips_and_merges(tiny_lm_folder, tmp_path):
    model = _healed(tiny_lm_folder)
    folder = ht.save_patch(model, tmp_path / "patch")
    assert (folder / "adapter" / "adapter_config.json").is_file()
    assert json.loads((folder / "adapter_config.json").read_text())["lora"] == "adapter"
    expected = logits(model)
    assert torch.equal(fresh_process_logits(folder, tmp_path), expected)
    loaded = ht.from_pretrained(folder)
    from peft import PeftModel

    assert isinstance(loaded, PeftModel) and ht.get_config(loaded).update == "norm_preserving"
    merged = ht.from_pretrained(folder, merge=True)
    assert type(merged).__name__ == "LlamaForCausalLM" and ht.get_config(merged).update == "norm_preserving"
    torch.testing.assert_close(logits(merged), expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(fresh_process_logits(legacy(folder), tmp_path), expected)  # format 2 still loads


def test_peft_reads_the_adapters_only_when_told_where(tiny_lm_folder, tmp_path):
    """AutoPeftModelForCausalLM on the repo must fail (it would return the base without the patch);
    PeftModel.from_pretrained onto the patched base, subfolder "adapter", gives the same logits."""
    from peft import AutoPeftModelForCausalLM, PeftModel

    model = _healed(tiny_lm_folder)
    folder = ht.save_patch(model, tmp_path / "patch")
    with pytest.raises(ValueError, match=r"also holds LoRA adapters trained on the patched model \(in adapter/\).*"
                                         r"hf_tangent.from_pretrained\(folder\)"):
        AutoPeftModelForCausalLM.from_pretrained(folder)
    with pytest.raises(ValueError, match="also holds LoRA adapters"):
        PeftModel.from_pretrained(base(tiny_lm_folder), folder)
    patched_base = ht.patch(base(tiny_lm_folder), ht.TangentConfig(update="norm_preserving"))
    peft = PeftModel.from_pretrained(patched_base, str(folder), subfolder="adapter")
    assert torch.equal(logits(peft), logits(model))


def test_a_different_base_is_refused_and_names_both(tiny_lm_folder, tmp_path):
    folder = ht.save_patch(gated(tiny_lm_folder), tmp_path / "patch")
    torch.manual_seed(7)  # same architecture, other weights
    LlamaForCausalLM(LlamaForCausalLM.from_pretrained(tiny_lm_folder).config).save_pretrained(tmp_path / "other")
    with pytest.raises(PatchRepoError, match=r"was made for base .*tiny_lm.* which does not match .*other.*the weights differ"):
        ht.from_pretrained(folder, base_model=str(tmp_path / "other"))
    config = LlamaForCausalLM.from_pretrained(tiny_lm_folder).config
    config.num_hidden_layers = 3
    LlamaForCausalLM(config).save_pretrained(tmp_path / "deeper")
    with pytest.raises(PatchRepoError, match=r"num_layers 2 \(recorded\) vs 3"):
        ht.from_pretrained(folder, base_model=str(tmp_path / "deeper"))
    with pytest.raises(PatchRepoError, match="could not be loaded .* pass base_model="):
        ht.from_pretrained(folder, base_model=str(tmp_path / "missing"))


def test_a_bfloat16_load_of_the_same_base_matches_its_fingerprint(tiny_lm_folder, tmp_path):
    folder = ht.save_patch(gated(tiny_lm_folder), tmp_path / "patch")
    model = ht.from_pretrained(folder, dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16 and ht.get_config(model).gates


def _edit(folder, change, name="adapter_config.json"):
    record = json.loads((folder / name).read_text())
    change(record)
    (folder / name).write_text(json.dumps(record))


@pytest.mark.parametrize("case, change, message", [
    ("no base", lambda r: r.pop("base"), r"field\(s\) \['base'\] missing"),
    ("bad base source", lambda r: r["base"].update(source="ftp"), "'base.source'='ftp'"),
    ("bad rule", lambda r: r["patch"].update(update="tangent"), "TangentConfig.update='tangent'"),
    ("unknown field", lambda r: r["patch"].update(gatez=True), r"TangentConfig: unknown keys \['gatez'\]"),
    ("missing field", lambda r: r["patch"].pop("alpha"), r"field\(s\) \['alpha'\] missing"),
    ("unknown top-level field", lambda r: r.update(update="retract"), r"unknown field\(s\) \['update'\]"),
    ("newer format", lambda r: r.update(format=4), "in patch format 4; this hf_tangent .* reads formats 1 to 3"),
    ("layer out of range", lambda r: r["patch"].update(layers=[5]),
     "layer index 5 is out of range for a model with 2 layers"),
    ("gates missing from the config", lambda r: r["patch"].update(gates=False),
     r"gates are saved for layers \[0, 1\], the patch gates layers \[\]"),
])
def test_damaged_records_are_one_clear_error(tiny_lm_folder, tmp_path, case, change, message):
    folder = ht.save_patch(gated(tiny_lm_folder), tmp_path / "patch")
    _edit(folder, change)
    with pytest.raises(PatchRepoError, match=message):
        ht.from_pretrained(folder)


@pytest.mark.parametrize("case, change, message", [
    ("newer format", lambda r: r.update(format=4), "in patch format 4; this hf_tangent .* reads formats 1 to 3: upgrade"),
    ("no base", lambda r: r.pop("base"), r"field\(s\) \['base'\] missing"),
    ("patched layers disagree", lambda r: r["patch"].update(patched_layers=[0]), "disagrees with the patch's config"),
    ("gates missing from the record", lambda r: r.update(gates=None),
     r"gates are saved for layers \[\], the patch gates layers \[0, 1\]"),
])
def test_damaged_format_2_records_are_one_clear_error(tiny_lm_folder, tmp_path, case, change, message):
    folder = legacy(ht.save_patch(gated(tiny_lm_folder), tmp_path / "patch"))
    _edit(folder, change, "hf_tangent_patch.json")
    with pytest.raises(PatchRepoError, match=message):
        ht.from_pretrained(folder)


@pytest.mark.parametrize("files", [("adapter_model.safetensors", "adapter_config.json"),
                                   ("gates.safetensors", "hf_tangent_patch.json")])
def test_damaged_files_are_one_clear_error(tiny_lm_folder, tmp_path, files):
    folder = ht.save_patch(gated(tiny_lm_folder), tmp_path / "patch")
    if files[0] == "gates.safetensors":
        legacy(folder)
    (folder / files[0]).write_bytes(b"\x00" * 16)
    with pytest.raises(PatchRepoError, match=f"{files[0]}: not a readable safetensors file"):
        ht.from_pretrained(folder)
    (folder / files[1]).write_text("{not json")
    with pytest.raises(PatchRepoError, match="not a valid JSON file"):
        ht.from_pretrained(folder)


def test_a_gate_tensor_the_config_has_no_gate_for_is_refused(tiny_lm_folder, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = ht.save_patch(ht.patch(base(tiny_lm_folder), ht.TangentConfig(update="projected", layers=[0])),
                           tmp_path / "patch")
    assert load_file(folder / "adapter_model.safetensors") == {}
    save_file({"base_model.model.model.layers.0.tangent_patch.peft.hf_tangent_gate": torch.ones(1)},
              folder / "adapter_model.safetensors")
    with pytest.raises(PatchRepoError, match=r"gates are saved for layers \[0\], the patch gates layers \[\]"):
        ht.from_pretrained(folder)


def test_adapters_that_do_not_fit_the_base_are_refused(tiny_lm_folder, tmp_path):
    folder = ht.save_patch(_healed(tiny_lm_folder), tmp_path / "patch")
    config = json.loads((folder / "adapter" / "adapter_config.json").read_text())
    config["target_modules"] = ["no_such_module"]
    (folder / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(PatchRepoError, match="LoRA adapters in adapter/ could not be loaded onto the base"):
        ht.from_pretrained(folder)


def test_loading_runs_no_code_from_the_repo(tiny_lm_folder, tmp_path):
    folder = ht.save_patch(gated(tiny_lm_folder), tmp_path / "patch")
    marker = tmp_path / "ran"
    for name in ("modeling_hf_tangent.py", "__init__.py", "configuration_hf_tangent.py"):
        (folder / name).write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    ht.from_pretrained(folder)
    assert not marker.exists()


def test_save_patch_refusals(tiny_lm_folder, tmp_path):
    with pytest.raises(ValueError, match="expects a model patched"):
        ht.save_patch(base(tiny_lm_folder), tmp_path / "p")
    model = ht.patch(LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                  num_hidden_layers=1, num_attention_heads=2)), ht.TangentConfig(update="zero"))
    with pytest.raises(ValueError, match=r"config._name_or_path is empty\); pass base_model="):
        ht.save_patch(model, tmp_path / "p")
    assert not (tmp_path / "p").exists()
    with pytest.raises(ValueError, match="base_model=, base_revision=, merge=, skip_base_check= and base_trust_remote_code= apply to patch repos"):
        ht.from_pretrained(tiny_lm_folder, merge=True)


def test_export_writes_a_complete_folder_that_loads_without_hf_tangent(tiny_lm_folder, tmp_path, capsys):
    from conftest import logits_without_hf_tangent

    from hf_tangent import cli

    model = _healed(tiny_lm_folder)
    ht.save_patch(model, tmp_path / "patch")
    assert cli.main(["export", "--patch", str(tmp_path / "patch"), "--output", str(tmp_path / "full")]) == 0
    assert (tmp_path / "full" / "model.safetensors").is_file() and (tmp_path / "full" / "tokenizer.json").is_file()
    torch.testing.assert_close(logits_without_hf_tangent(tmp_path / "full", IDS, tmp_path), logits(model),
                               rtol=1e-4, atol=1e-4)
    capsys.readouterr()
    assert cli.main(["export", "--patch", str(tmp_path / "nowhere"), "--output", str(tmp_path / "x")]) == 2
    assert "hf-tangent export: error: hf_tangent: " in capsys.readouterr().err


def test_push_patch_uploads_the_patch_repo_and_refuses_other_folders(tiny_lm_folder, tmp_path, monkeypatch):
    import huggingface_hub

    calls = {}
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo",
                        lambda self, repo_id, **kw: calls.__setitem__("create", (repo_id, kw)))

    def fake_upload_folder(self, repo_id, folder_path, **kwargs):
        calls["files"] = sorted(p.name for p in __import__("pathlib").Path(folder_path).iterdir())
        calls["record"] = read_record(folder_path)
        return "commit"

    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", fake_upload_folder)
    assert ht.push_patch(gated(tiny_lm_folder), "user/tiny-patch", base_model=str(tiny_lm_folder), private=True) == "commit"
    assert calls["create"] == ("user/tiny-patch", {"private": True, "exist_ok": True})
    assert calls["files"] == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    assert calls["record"]["base"]["name_or_path"] == str(tiny_lm_folder)
    with pytest.raises(ValueError, match=r"push_patch: .* is not a patch folder \(no adapter_config.json\)"):
        ht.push_patch(tiny_lm_folder, "user/x")


def test_a_model_whose_blocks_are_parallel_already_round_trips(tmp_path):
    """Format 3 records no layer lists; compared with the config's, a GPT-NeoX patch repo with parallel_layers (its
    blocks are parallel already: the patch records no conversion) was refused at load (the conformance matrix)."""
    from architectures import build

    model = build("gpt_neox")
    model.save_pretrained(tmp_path / "base")
    ht.patch(model, ht.TangentConfig(update="projected", gates=True, parallel_layers=[0]))
    folder = ht.save_patch(model, tmp_path / "patch", base_model=str(tmp_path / "base"))
    assert torch.equal(logits(ht.from_pretrained(folder), IDS % 64), logits(model, IDS % 64))
