"""The conformance matrix (tests/conformance.py): the seed families and one MoE in every run, the kept report
of the whole matrix fresh against the code it was measured on, and each defect the matrix found pinned."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers
from architectures import PROBE_IDS, build
from conformance import (
    DOC,
    LOADERS,
    MADE_FOR,
    SEED_TYPES,
    VARIANTS,
    check_type,
    core_digest,
    kept_reports,
    made_for,
    render,
)
from transformers import AutoModelForCausalLM

import hf_tangent as ht

pytestmark = pytest.mark.core  # the oldest transformers runs these too (.ci/run)


def _logits(model):
    with torch.no_grad():
        return model.eval()(input_ids=PROBE_IDS, use_cache=False).logits


@pytest.mark.parametrize("model_type", SEED_TYPES)
def test_seed_family_every_artifact_every_loader(model_type, tmp_path):
    row = check_type(model_type, tmp_path)
    bad = [c for c in row["cells"] if c["status"] in ("wrong", "error")]
    assert not bad, bad
    exact = {(c["variant"], c["artifact"], c["loader"], c["dtype"]) for c in row["cells"] if c["status"] == "exact"}
    # every artifact made for a loader loads exactly through it, in float32 for every variant the type takes
    taken = [v for v in VARIANTS if f"{v}: refused at patch" not in row["note"]]
    assert "projected, gates, parallel layer 0" in taken and "retract p=2, last layer, lambda 0.5" in taken
    for variant in taken:
        artifacts = {c["artifact"] for c in row["cells"] if c["variant"] == variant}
        for artifact, loader in MADE_FOR:
            if artifact in artifacts and made_for(artifact, loader, VARIANTS[variant][3]):
                assert (variant, artifact, loader, "float32") in exact, (variant, artifact, loader)
    assert ("projected, gates, parallel layer 0", "hub folder", "transformers", "bfloat16") in exact
    # the LoRA patch repo: hf_tangent loads it exactly, PEFT's own loaders refuse it (and its adapter/ folder)
    lora = [c for c in row["cells"] if c["variant"] == "projected, gates, LoRA" and c["artifact"] == "patch repo"]
    assert {c["loader"]: c["status"] for c in lora} == {"transformers": "refused", "no remote code": "refused",
                                                       "hf_tangent": "exact", "AutoPeftModel": "refused",
                                                       "PeftModel": "refused", "load_adapter": "refused"}
    # LoRA trained on the patched model, saved by the PeftModel as the Trainer does: no loader returns it unpatched
    lora_run = [c for c in row["cells"] if c["variant"] == "projected, gates, LoRA" and c["artifact"] == "output_dir"]
    assert lora_run and all(c["status"] in ("exact", "refused") for c in lora_run), lora_run
    # without LoRA the patch repo is a PEFT adapter folder: PEFT's three loaders load it exactly
    plain = [c for c in row["cells"] if c["variant"] == "projected, gates, parallel layer 0"
             and c["artifact"] == "patch repo" and c["dtype"] == "float32"]
    assert {c["loader"]: c["status"] for c in plain if c["loader"] in ("AutoPeftModel", "PeftModel", "load_adapter")} \
        == dict.fromkeys(("AutoPeftModel", "PeftModel", "load_adapter"), "exact")


def test_kept_matrix_is_fresh_and_holds_no_wrong_cell():
    reports = kept_reports()
    versions = {r["versions"]["transformers"] for r in reports}
    assert "4.57.1" in versions and any(v.startswith("5.") for v in versions), versions  # CI's oldest and newest
    for report in reports:
        assert report["core_digest"] == core_digest(), (
            f"docs/results/conformance (transformers {report['versions']['transformers']}) was measured on other "
            "core/ or artifacts/ code: run `python tests/conformance.py` in each environment .ci/run makes")
        cells = [c for row in report["rows"] for c in row["cells"]]
        assert not [c for c in cells if c["status"] in ("wrong", "error")]
        assert {c["loader"] for c in cells} == set(LOADERS)
        for model_type in SEED_TYPES:
            assert any(row["type"] == model_type and row["cells"] for row in report["rows"]), model_type
    assert DOC.read_text(encoding="utf-8") == render(reports), "run `python tests/conformance.py --render`"


def test_render_counts_cells_by_loader_and_names_the_versions():
    report = {"versions": {"transformers": "9.9", "torch": "2", "peft": "1", "hf_tangent": "0"}, "seconds": 3,
              "rows": [{"type": "t", "family": "f", "note": "", "cells": [
                  {"loader": "transformers", "status": "exact"}, {"loader": "transformers", "status": "exact"},
                  {"loader": "AutoPeftModel", "status": "refused"}, {"loader": "hf_tangent", "status": "wrong"}]},
                  {"type": "u", "family": "f", "note": "not patched", "cells": []}]}
    page = render([report])
    assert "## transformers 9.9 (torch 2, PEFT 1, hf_tangent 0)" in page and "1 types patched, 4 cells in 3 s." in page
    assert "| transformers | 2 | 0 | 0 | 0 | 0 |" in page and "| hf_tangent | 0 | 0 | 0 | 1 | 0 |" in page
    assert "| AutoPeftModel | 0 | 1 | 0 | 0 | 0 |" in page
    assert "| t | f | exact 2 |  | wrong 1 | refused 1 |  |" in page
    assert "refused at patch time, as\n[architectures.md](architectures.md) says): u." in page


# ----------------------------------------------------------------------------- defects the matrix found
def _saved(model, tmp_path, name="folder"):
    ht.save_hub_folder(model, tmp_path / name)
    return tmp_path / name


@pytest.mark.parametrize("model_type", ["falcon_h1", "diffllama", "emu3"])
def test_remote_code_and_hf_tangent_load_types_that_failed(model_type, tmp_path):
    """falcon_h1: an inf in its config (transformers writes {"__float__": "Infinity"}) was refused by
    ht.from_pretrained, and the remote class left its non-persistent mup_vector uninitialised (NaN logits:
    transformers 5 initialises custom code's modules differently); diffllama: a gate created on the meta device
    failed the remote load; emu3 (emu3_text_model): no AutoModelForCausalLM entry, so ht.from_pretrained failed."""
    try:
        base = build(model_type)
    except Exception as err:  # noqa: BLE001 - emu3 has no tiny build on transformers 4.57
        if transformers.__version__.startswith("5."):
            raise
        pytest.skip(f"{model_type} does not build tiny on transformers {transformers.__version__}: {err}")
    model = ht.patch(base, ht.TangentConfig(update="projected", gates=True, eps_mode="relative"))
    with torch.no_grad():
        for child in ht.tangent_layers(model):
            child.gate.fill_(0.7)
    ref = _logits(model)
    folder = _saved(model, tmp_path)
    remote = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    for loaded in (remote, ht.from_pretrained(folder)):
        out = _logits(loaded)
        assert torch.isfinite(out).all()
        assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_fused_parallel_survives_kernelize_and_mode_changes(tmp_path):
    """transformers 5 `kernelize`s a model in from_pretrained and on every train/eval switch, which put back
    the RMSNorms' own forward that the fused path had replaced: the norm gains applied twice, silently."""
    base = build("llama")
    base.save_pretrained(tmp_path / "base")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "base")  # kernelized (use_kernels defaults on)
    hooks = ht.patch(copy.deepcopy(loaded), ht.TangentConfig(parallel_layers=[0, 1], update="projected"))
    fused = ht.patch(loaded, ht.TangentConfig(parallel_layers=[0, 1], update="projected", parallel_execution="fused"))
    ref = _logits(hooks)
    assert (_logits(fused) - ref).abs().max() <= 1e-5 * ref.abs().max()
    fused.train()
    fused.eval()  # each switch re-kernelizes
    assert (_logits(fused) - ref).abs().max() <= 1e-5 * ref.abs().max()
    folder = _saved(fused, tmp_path)
    remote = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    assert (_logits(remote) - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_fused_parallel_refuses_a_projection_replaced_after_the_patch():
    model = ht.patch(build("llama"), ht.TangentConfig(parallel_layers=[0], parallel_execution="fused"))
    q_proj = model.model.layers[0].self_attn.q_proj
    q_proj.__class__ = torch.nn.Linear  # as a tool that puts the module's own class back would: it now reads the
    with pytest.raises(RuntimeError, match="cannot be multiplied"):  # fused projections, never a wrong result
        _logits(model)


def test_a_homotopy_below_one_on_fused_parallel_layers_is_refused_and_leaves_the_model_as_it_was():
    """set_homotopy(0.6) on fused parallel layers was accepted and every later forward failed (the FFN read
    a blended input that the fused GEMM cannot give), blaming an adapter; update_config to fused on a blended
    model likewise. Refused, the model unchanged; lambda 1 on the fused layers and any lambda elsewhere run."""
    fused = ht.TangentConfig(update="projected", parallel_layers=[0], parallel_execution="fused")
    model = ht.patch(build("llama"), fused)
    before = _logits(model)
    for value in (0.6, 0.0, {0: 0.5, 1: 1.0}):
        with pytest.raises(ValueError, match=r"set_homotopy: homotopy lambda \[0\.[0-9]+\] on layers \[0\], which run "
                                             r"with parallel_execution='fused'.*accepted: lambda 1 on those layers"):
            ht.set_homotopy(model, value)
        assert ht.get_homotopy(model) == 1.0 and torch.equal(_logits(model), before)
    ht.set_homotopy(model, {0: 1.0, 1: 0.5})  # layer 1 is patched, not parallel
    hooks = ht.patch(build("llama"), ht.TangentConfig(update="projected", parallel_layers=[0]))
    ht.set_homotopy(hooks, {0: 1.0, 1: 0.5})
    ref = _logits(hooks)
    assert (_logits(model) - ref).abs().max() <= 1e-5 * ref.abs().max()
    ht.set_homotopy(hooks, 0.6)
    blended, state = _logits(hooks), copy.deepcopy(hooks.state_dict())
    with pytest.raises(ValueError, match=r"update_config: homotopy lambda \[0\.6\] on layers \[0\]"):
        ht.update_config(hooks, parallel_execution="fused")
    assert ht.get_config(hooks).parallel_execution == "hooks" and ht.get_homotopy(hooks) == 0.6
    assert torch.equal(_logits(hooks), blended) and all(torch.equal(v, state[k]) for k, v in hooks.state_dict().items())


@pytest.mark.parametrize("model_type", ["falcon", "gptj", "phi", "cohere"])
def test_parallel_residual_families_patch_in_bfloat16(model_type, tmp_path):
    """Discovery's tolerance was float32's whatever the model's dtype (read after the cast to double), so a
    parallel block's three-term sum, rounded in bfloat16 in another order, never matched: these families were
    refused in bfloat16 and float16 as having no FFN. The patched bfloat16 model follows the float32 one as
    closely as the unpatched pair does."""
    base = build(model_type)
    base.save_pretrained(tmp_path / "base")
    low = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.bfloat16).eval()
    drift = (_logits(low).float() - _logits(base)).abs().max()
    config = ht.TangentConfig(update="projected")
    patched, ref = _logits(ht.patch(low, config)).float(), _logits(ht.patch(copy.deepcopy(base), config))
    assert not torch.equal(ref, _logits(base))
    assert (patched - ref).abs().max() <= 4 * drift + 1e-2 * ref.abs().max(), ((patched - ref).abs().max(), drift)


def test_api_works_on_a_model_loaded_through_remote_code(tmp_path):
    """Each function used to see no patch on such a model (its layers were the folder's copy's classes):
    unpatch returned and left it patched, disabled and set_homotopy changed nothing, update_config failed. With
    hf_tangent installed at the folder's release the remote code now hands the patch to it (a model patched by
    the folder's copy: tests/test_artifact_safety.py)."""
    base = build("llama")
    unpatched = _logits(base)
    model = ht.patch(copy.deepcopy(base), ht.TangentConfig(update="projected", gates=True, eps_mode="relative"))
    with torch.no_grad():
        for child in ht.tangent_layers(model):
            child.gate.fill_(0.5)
    ref = _logits(model)
    remote = AutoModelForCausalLM.from_pretrained(_saved(model, tmp_path), trust_remote_code=True)
    assert type(remote).__module__.startswith("transformers_modules")
    assert [c.index for c in ht.tangent_layers(remote)] == [0, 1]
    config = ht.get_config(remote)
    assert isinstance(config, ht.TangentConfig) and config.update == "projected" and config.is_frozen
    with ht.disabled(remote):
        assert torch.equal(_logits(remote), unpatched)
        with pytest.raises(ValueError, match="inside `with hf_tangent.disabled"):
            ht.unpatch(remote)
    assert torch.equal(_logits(remote), ref)
    ht.set_homotopy(remote, 0.0)
    assert ht.get_homotopy(remote) == 0.0 and torch.equal(_logits(remote), unpatched)
    ht.set_homotopy(remote, 1.0)
    from hf_tangent.core.options import RangeError  # a refusal by the folder's copy comes as this copy's class
    with pytest.raises(RangeError, match=r"TangentConfig\.beta=5 is out of range"):
        ht.update_config(remote, beta=5)
    ht.update_config(remote, update="retract", p=2.0)
    assert ht.get_config(remote).update == "retract" and [c.gate.item() for c in ht.tangent_layers(remote)] == [0.5, 0.5]
    expected = ht.update_config(copy.deepcopy(model), update="retract", p=2.0)
    assert (_logits(remote) - _logits(expected)).abs().max() <= 1e-6 * ref.abs().max()
    ht.unpatch(remote)
    assert ht.get_config(remote) is None and ht.tangent_layers(remote) == []
    assert torch.equal(_logits(remote), unpatched)


def test_save_patch_of_a_model_loaded_from_a_complete_folder(tmp_path):
    """Its config names the patched folder, which a patch repo cannot point at as its (unpatched) base."""
    base = build("gpt_neox")
    base.save_pretrained(tmp_path / "base")
    model = ht.patch(copy.deepcopy(base), ht.TangentConfig(update="projected", gates=True, eps_mode="relative"))
    with torch.no_grad():
        for child in ht.tangent_layers(model):
            child.gate.fill_(1.5)
    folder = _saved(model, tmp_path)
    for loaded in (AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True), ht.from_pretrained(folder)):
        with pytest.raises(ValueError, match="a complete patched folder, but a patch repo points at an unpatched base"):
            ht.save_patch(loaded, tmp_path / "refused")
        assert not (tmp_path / "refused").exists()
        repo = ht.save_patch(loaded, tmp_path / f"repo-{id(loaded)}", base_model=str(tmp_path / "base"))
        record = json.loads((repo / "adapter_config.json").read_text())
        assert record["base"]["architecture"] == "GPTNeoXForCausalLM"
        assert torch.equal(_logits(ht.from_pretrained(repo)), _logits(model))


def test_remote_code_load_in_a_fresh_process_without_hf_tangent_importable(tmp_path):
    """The folder's remote code alone (hf_tangent cannot be imported in that process): GPT-NeoX, whose
    `embed_out` the base's save writes and transformers 5 renames on load for its own model_type only."""
    model = ht.patch(build("gpt_neox"), ht.TangentConfig(update="projected", eps_mode="relative"))
    folder = _saved(model, tmp_path)
    torch.save(_logits(model), tmp_path / "ref.pt")
    script = textwrap.dedent(f"""
        import sys
        sys.modules["hf_tangent"] = None  # import hf_tangent fails here
        import torch
        from transformers import AutoModelForCausalLM
        sys.path.insert(0, {str(sys.path[0])!r})
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        ids = torch.tensor([[1 + (13 * i + 5) % 200 for i in range(7)]])
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=False).logits
        ref = torch.load({str(tmp_path / "ref.pt")!r})
        assert (out - ref).abs().max() <= 1e-5 * ref.abs().max(), (out - ref).abs().max()
        print("exact")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "exact" in result.stdout, result.stderr[-2000:]


def test_remote_code_moe_takes_the_base_experts_kernel_in_any_load_order(tmp_path):
    """transformers decides whether a class may set its experts (and attention) implementation by reading the
    source of the class's module: the remote module has none of the base's code, so a fresh process that loads
    the folder first ran Mixtral's experts eagerly (bfloat16 logits 6e-3 of the logit scale away from the base
    class's grouped_mm) and refused experts_implementation=...; the matrix loads the base class first in the same
    process, which set the answer, so it missed it."""
    build("mixtral").save_pretrained(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.bfloat16)
    model = ht.patch(base.eval(), ht.TangentConfig(update="soft", alpha=0.7))
    folder = _saved(model, tmp_path)
    torch.save(_logits(model), tmp_path / "ref.pt")
    expected = getattr(model.config, "_experts_implementation", None)
    script = textwrap.dedent(f"""
        import sys
        sys.modules["hf_tangent"] = None  # import hf_tangent fails here
        import torch
        from transformers import AutoModelForCausalLM
        sys.path.insert(0, {str(sys.path[0])!r})
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True, dtype=torch.bfloat16)
        assert getattr(model.config, "_experts_implementation", None) == {expected!r}, model.config._experts_implementation
        ids = torch.tensor([[1 + (13 * i + 5) % 200 for i in range(7)]])
        with torch.no_grad():
            out = model.eval()(input_ids=ids, use_cache=False).logits
        ref = torch.load({str(tmp_path / "ref.pt")!r})
        assert torch.equal(out, ref), (out.float() - ref.float()).abs().max() / ref.float().abs().max()
        if {expected is not None!r}:  # transformers 5: the request is taken, as by the base class
            AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True,
                                                 experts_implementation="eager")
        print("exact")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "exact" in result.stdout, result.stderr[-2000:]


def test_lora_on_the_hooked_linear_goes_through_the_rule():
    """BioGPT's FFN output is `fc2` itself, so the rule's hook sat on the Linear that PEFT wraps: the adapter's
    update was added after the rule, unprojected (merged and unmerged models differed by ~14 % of the logit
    scale). The reference merges the adapter into the weights by hand, then patches."""
    from peft import LoraConfig, get_peft_model

    base = build("biogpt")
    config = ht.TangentConfig(update="projected", eps_mode="relative")
    torch.manual_seed(1)
    peft = get_peft_model(ht.patch(copy.deepcopy(base), config),
                          LoraConfig(target_modules=["fc2"], r=4, lora_alpha=8, init_lora_weights=False))
    merged = copy.deepcopy(base)
    with torch.no_grad():
        for name, module in peft.named_modules():
            if name.endswith(".fc2") and hasattr(module, "lora_A"):
                target = merged.get_submodule(name.removeprefix("base_model.model."))
                target.weight += module.scaling["default"] * module.lora_B["default"].weight @ module.lora_A["default"].weight
    expected = _logits(ht.patch(merged, config))
    assert (_logits(peft) - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert (_logits(peft.merge_and_unload()) - expected).abs().max() <= 1e-5 * expected.abs().max()
