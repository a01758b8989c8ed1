"""Issue 57: the patch as a PEFT method. `get_peft_model(base, TangentPeftConfig(...))` patches; its adapter folder
loads with the in-memory logits in every loader PEFT and transformers give (PeftModel, AutoPeftModelForCausalLM,
load_adapter, pipeline), in a fresh process; disable_adapter() and unload() are the base bit for bit;
merge_and_unload() saves a complete patched folder; TRL's SFTTrainer trains the gates only and resumes them."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import tiny_smollm2_llama
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

import hf_tangent as ht

IDS = torch.tensor([[1, 5, 9, 33, 2, 17, 40]])


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("peft_base") / "base"
    _, tokenizer = tiny_smollm2_llama(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _base(folder):
    return AutoModelForCausalLM.from_pretrained(folder).eval()


def _adapter(folder, **fields):
    model = get_peft_model(_base(folder), ht.TangentPeftConfig(task_type="CAUSAL_LM", **fields))
    with torch.no_grad():
        for i, child in enumerate(ht.tangent_layers(model)):
            if child.gate is not None:
                child.gate.fill_(0.6 + 0.3 * i)
    return model.eval()


_LOADERS = r"""
import sys, torch
import hf_tangent
from peft import AutoPeftModelForCausalLM, PeftModel
from transformers import AutoModelForCausalLM, pipeline
adapter, base, io = sys.argv[1:4]
ids, live = torch.load(io)
out = {}
with torch.no_grad():
    out["PeftModel"] = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()(ids).logits
    out["AutoPeftModelForCausalLM"] = AutoPeftModelForCausalLM.from_pretrained(adapter).eval()(ids).logits
    model = AutoModelForCausalLM.from_pretrained(base)
    model.load_adapter(adapter)
    out["load_adapter"] = model.eval()(ids).logits
    out["pipeline"] = pipeline("text-generation", model=adapter).model.eval()(ids).logits
for name, logits in out.items():
    assert torch.equal(logits, live), (name, (logits - live).abs().max())
print("ok", sorted(out))
"""


@pytest.mark.parametrize("fields", [dict(update="projected", gates=True), dict(update="retract", p=2.0, layers=(1,)),
                                    dict(update="soft", beta=0.5, gates=True, alpha=0.8)])
def test_the_adapter_folder_loads_exactly_in_every_loader_of_a_fresh_process(base_folder, tmp_path, fields):
    model = _adapter(base_folder, **fields)
    with torch.no_grad():
        live = model(IDS).logits
        plain = _base(base_folder)(IDS).logits
    assert not torch.equal(live, plain)  # the patch changes the model: equal logits below mean it was loaded
    model.save_pretrained(tmp_path / "adapter")
    assert sorted(os.listdir(tmp_path / "adapter")) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["peft_type"] == "HF_TANGENT" and saved["patch"]["update"] == fields["update"] and saved["format"] == 3
    assert saved["base"]["fingerprint"]["digests"] and saved["base"]["num_layers"] == 2
    torch.save((IDS, live), tmp_path / "io.pt")
    result = subprocess.run([sys.executable, "-c", _LOADERS, str(tmp_path / "adapter"), str(base_folder),
                             str(tmp_path / "io.pt")], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_disable_adapter_and_unload_are_the_base_bit_for_bit(base_folder):
    base = _base(base_folder)
    keys = list(base.state_dict())
    with torch.no_grad():
        plain = base(IDS).logits
    model = _adapter(base_folder, update="projected", gates=True)
    with torch.no_grad():
        live = model(IDS).logits
        with model.disable_adapter():
            assert torch.equal(model(IDS).logits, plain)
        assert torch.equal(model(IDS).logits, live)
    unloaded = model.unload()
    assert ht.get_config(unloaded) is None and list(unloaded.state_dict()) == keys
    with torch.no_grad():
        assert torch.equal(unloaded(IDS).logits, plain)


def test_merge_and_unload_saves_a_complete_patched_folder_with_its_gates(base_folder, tmp_path):
    model = _adapter(base_folder, update="projected", gates=True)
    with torch.no_grad():
        live = model(IDS).logits
    merged = model.merge_and_unload()
    assert ht.get_config(merged).gates and sorted(c.gate.item() for c in ht.tangent_layers(merged)) == \
        pytest.approx([0.6, 0.9])
    merged.save_pretrained(tmp_path / "full")
    with torch.no_grad():
        assert torch.equal(ht.from_pretrained(tmp_path / "full")(IDS).logits, live)


def test_is_trainable_trains_the_gates_only_and_saves_what_it_trained(base_folder, tmp_path):
    _adapter(base_folder, update="projected", gates=True).save_pretrained(tmp_path / "a")
    model = PeftModel.from_pretrained(_base(base_folder), tmp_path / "a", is_trainable=True)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 and all(n.endswith(".peft.hf_tangent_gate.default") for n in trainable)
    frozen = PeftModel.from_pretrained(_base(base_folder), tmp_path / "a")
    assert not any(p.requires_grad for p in frozen.parameters())
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model.train()
    model(IDS, labels=IDS).loss.backward()
    optimizer.step()
    gates = [c.gate.item() for c in ht.tangent_layers(model)]
    assert gates != pytest.approx([0.6, 0.9])
    model.save_pretrained(tmp_path / "b")
    again = PeftModel.from_pretrained(_base(base_folder), tmp_path / "b")
    assert [c.gate.item() for c in ht.tangent_layers(again)] == gates


def test_sft_trainer_trains_the_gates_only_and_resumes_them(base_folder, tmp_path):
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_folder)
    data = Dataset.from_dict({"text": ["It is a truth universally acknowledged, that a single man in possession"] * 8})

    def trainer(steps):
        args = trl.SFTConfig(output_dir=str(tmp_path / "run"), max_steps=steps, save_steps=1, learning_rate=0.2,
                             per_device_train_batch_size=2, report_to=[], use_cpu=True, max_length=32, seed=0)
        return trl.SFTTrainer(model=_base(base_folder), args=args, train_dataset=data, processing_class=tokenizer,
                              peft_config=ht.TangentPeftConfig(update="projected", gates=True, task_type="CAUSAL_LM"))

    first = trainer(2)
    base_before = {n: p.detach().clone() for n, p in first.model.get_base_model().named_parameters() if "peft." not in n}
    first.train()
    gates = [c.gate.item() for c in ht.tangent_layers(first.model)]
    assert gates != pytest.approx([1.0, 1.0])
    assert all(torch.equal(p, base_before[n]) for n, p in first.model.get_base_model().named_parameters()
               if n in base_before)
    saved = json.loads((tmp_path / "run" / "checkpoint-2" / "adapter_config.json").read_text())
    assert saved["peft_type"] == "HF_TANGENT"
    resumed = trainer(2)  # resuming at the last step trains nothing: the gates are the checkpoint's
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert [c.gate.item() for c in ht.tangent_layers(resumed.model)] == gates
    resumed.save_model()
    loaded = PeftModel.from_pretrained(_base(base_folder), tmp_path / "run")
    assert [c.gate.item() for c in ht.tangent_layers(loaded)] == gates


def test_invalid_fields_get_tangent_configs_errors_under_their_own_name():
    import re

    for fields in (dict(beta=1.5), dict(update="projekted"), dict(retraction="cayley"), dict(layers=(1.5,)),
                   dict(p=float("nan")), dict(alpha="1"), dict(branches=("ffn", "ffn"))):
        with pytest.raises((ValueError, TypeError)) as theirs:
            ht.TangentConfig(**fields)
        with pytest.raises(type(theirs.value)) as ours:
            ht.TangentPeftConfig(**fields)
        assert re.sub(r"\bTangentPeftConfig\.", "TangentConfig.", str(ours.value)) == str(theirs.value)
    with pytest.raises(TypeError, match=r"TangentPeftConfig.base='x' has the wrong type \(str\)"):
        ht.TangentPeftConfig(base="x")


def test_another_base_is_refused_by_its_fingerprint(base_folder, tmp_path):
    _adapter(base_folder, update="projected").save_pretrained(tmp_path / "a")
    other, _ = tiny_smollm2_llama()
    with torch.no_grad():
        other.model.layers[0].mlp.up_proj.weight.mul_(1.01)
    with pytest.raises(ValueError, match="the weights differ"):
        PeftModel.from_pretrained(other, tmp_path / "a")
    assert ht.get_config(other) is None


def test_a_second_tangent_adapter_and_a_patched_base_are_refused_by_name(base_folder):
    model = _adapter(base_folder, update="projected")
    with pytest.raises(ValueError, match="adapter 'second' refused: the model already carries an hf_tangent patch "
                                         r"\(adapter 'default'\)"):
        model.add_adapter("second", ht.TangentPeftConfig(update="retract"))
    patched = ht.patch(_base(base_folder), ht.TangentConfig(update="projected"))
    with pytest.raises(ValueError, match=r"adapter 'default' refused: .*\(hf_tangent.patch\)"):
        get_peft_model(patched, ht.TangentPeftConfig(update="retract"))


def test_a_process_without_hf_tangent_gets_peft_s_key_error_naming_the_type(base_folder, tmp_path):
    _adapter(base_folder, update="projected").save_pretrained(tmp_path / "a")
    script = ("import sys\nfrom peft import AutoPeftModelForCausalLM\ntry:\n    AutoPeftModelForCausalLM.from_pretrained("
              "sys.argv[1])\nexcept KeyError as err:\n    print('KeyError', err)\n"
              "assert not any(m.startswith('hf_tangent') for m in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "a")], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0 and result.stdout.strip() == "KeyError 'HF_TANGENT'", result.stderr[-2000:]


def test_registration_refuses_a_peft_whose_tables_moved(monkeypatch):
    from peft import mapping

    from hf_tangent.artifacts.adapter import register

    monkeypatch.delattr(mapping, "PEFT_TYPE_TO_TUNER_MAPPING")
    with pytest.raises(ImportError, match="no PEFT_TYPE_TO_TUNER_MAPPING in peft.mapping"):
        register()


# ----------------------------------------------------------------------------- defects the fresh-eyes review found
def test_disable_adapter_twice_comes_back_each_time(base_folder):
    """The holders' flags were set while the patch was off (no holders found): after a second block the model
    stayed the base for good (TRL's DPO disables the adapter every step)."""
    model = _adapter(base_folder, update="projected", gates=True)
    with torch.no_grad():
        live, plain = model(IDS).logits, _base(base_folder)(IDS).logits
        for _ in range(3):
            with model.disable_adapter():
                assert torch.equal(model(IDS).logits, plain)
            assert torch.equal(model(IDS).logits, live) and model.get_model_status().enabled is True


def test_a_save_inside_disable_adapter_is_refused(base_folder, tmp_path):
    model = _adapter(base_folder, update="projected", gates=True)
    with model.disable_adapter(), pytest.raises(ValueError, match="the tangent adapter is off"):
        model.save_pretrained(tmp_path / "a")


def _saved(base_folder, tmp_path, **fields):
    _adapter(base_folder, update="projected", gates=True, **fields).save_pretrained(tmp_path / "a")
    return tmp_path / "a"


@pytest.mark.parametrize("case", ["nan", "missing", "int", "extra base weight", "shape"])
def test_a_damaged_weights_file_is_refused_by_peft_s_loaders(base_folder, tmp_path, case):
    from safetensors.torch import load_file, save_file

    folder = _saved(base_folder, tmp_path)
    tensors = load_file(folder / "adapter_model.safetensors")
    key = sorted(tensors)[0]
    if case == "nan":
        tensors[key] = torch.tensor([float("nan")])
    elif case == "missing":
        del tensors[key]
    elif case == "int":
        tensors[key] = torch.tensor([1])
    elif case == "shape":
        tensors[key] = torch.ones(2)
    else:
        tensors["base_model.model.model.layers.0.mlp.down_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, folder / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="adapter_model.safetensors does not fit the adapter's patch"):
        PeftModel.from_pretrained(_base(base_folder), folder)
    with pytest.raises(ValueError, match="adapter_model.safetensors|gates are saved for layers"):
        ht.from_pretrained(folder)


def test_a_gate_transformers_load_adapter_does_not_fill_is_nan_not_one(base_folder, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _saved(base_folder, tmp_path)
    tensors = load_file(folder / "adapter_model.safetensors")
    del tensors[sorted(tensors)[0]]
    save_file(tensors, folder / "adapter_model.safetensors")
    model = _base(base_folder)
    model.load_adapter(str(folder))
    with torch.no_grad():
        assert torch.isnan(model(IDS).logits).all()


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["patch"].pop("update"), r"field\(s\) \['update'\] missing"),
    (lambda c: c["patch"].update(updat="projected"), r"unknown keys \['updat'\]"),
    (lambda c: c["patch"].update(beta=float("nan")), "TangentConfig.beta"),
    (lambda c: c.update(base=None), "field 'base' must be the base's record"),
    (lambda c: c.update(format=4), r"TangentPeftConfig.format=4 is out of range; accepted: an integer >= 3 and <= 3"),
    (lambda c: c.update(update="retract"), r"\['update'\] given beside 'patch'"),
    # a list equal to the default beside 'patch' (it was read as the tuple default, and passed)
    (lambda c: c.update(parallel_layers=[]), r"\['parallel_layers'\] given beside 'patch'"),
    (lambda c: c.update(branches=["ffn"]), r"\['branches'\] given beside 'patch'"),
    (lambda c: c.update(homotopy="x"), "TangentPeftConfig.homotopy='x'"),
])
def test_a_hand_edited_config_is_refused_never_defaulted(base_folder, tmp_path, edit, message):
    folder = _saved(base_folder, tmp_path)
    config = json.loads((folder / "adapter_config.json").read_text())
    edit(config)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        PeftModel.from_pretrained(_base(base_folder), folder)


def test_ht_and_peft_read_each_other_s_adapter_folders(base_folder, tmp_path, recwarn):
    model = _adapter(base_folder, update="projected", gates=True)
    with torch.no_grad():
        live = model(IDS).logits
    model.save_pretrained(tmp_path / "peft")
    with torch.no_grad():
        assert torch.equal(ht.from_pretrained(tmp_path / "peft")(IDS).logits, live)
    ht.save_patch(model, tmp_path / "ht")  # the PeftModel of the tangent adapter is the patch: no adapter/
    assert not (tmp_path / "ht" / "adapter").exists()
    recwarn.clear()
    with torch.no_grad():
        assert torch.equal(PeftModel.from_pretrained(_base(base_folder), tmp_path / "ht")(IDS).logits, live)
    assert not [w for w in recwarn if "Unexpected keyword" in str(w.message)]


def test_an_adapter_of_an_unnamed_model_loads(tmp_path):
    base, _ = tiny_smollm2_llama()
    state = {k: v.clone() for k, v in base.state_dict().items()}
    model = get_peft_model(base, ht.TangentPeftConfig(update="projected", task_type="CAUSAL_LM"))
    with torch.no_grad():
        live = model(IDS).logits
    model.save_pretrained(tmp_path / "a")
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["base"]["name_or_path"] == "(unnamed model)"
    again, _ = tiny_smollm2_llama()
    assert all(torch.equal(v, state[k]) for k, v in again.state_dict().items())
    with torch.no_grad():
        assert torch.equal(PeftModel.from_pretrained(again, tmp_path / "a")(IDS).logits, live)


def test_a_tangent_peft_model_pickles(base_folder, tmp_path):
    model = _adapter(base_folder, update="projected", gates=True)
    torch.save(model, tmp_path / "m.pt")
    again = torch.load(tmp_path / "m.pt", weights_only=False)
    with torch.no_grad():
        assert torch.equal(again(IDS).logits, model(IDS).logits)


def test_a_refused_second_adapter_leaves_no_config(base_folder, tmp_path):
    folder = _saved(base_folder, tmp_path)
    model = _base(base_folder)
    model.load_adapter(str(folder))
    with pytest.raises(ValueError, match="adapter 'second' refused"):
        model.load_adapter(str(folder), adapter_name="second")
    assert list(model.peft_config) == ["default"]


# ----------------------------------------------------------------------------- the second review's defects
def test_a_save_after_update_config_is_refused_not_the_old_rule(base_folder, tmp_path):
    model = _adapter(base_folder, update="projected", gates=True)
    ht.update_config(model, update="soft", beta=0.3)
    with pytest.raises(ValueError, match=r"the patch was changed \(hf_tangent.update_config or patch\)"):
        model.save_pretrained(tmp_path / "a")


def test_one_config_object_makes_two_adapters(base_folder):
    config = ht.TangentPeftConfig(update="projected", gates=True, task_type="CAUSAL_LM")
    first, second = get_peft_model(_base(base_folder), config), get_peft_model(_base(base_folder), config)
    with torch.no_grad():
        assert torch.equal(first(IDS).logits, second(IDS).logits) and torch.isfinite(second(IDS).logits).all()


def test_a_refused_load_leaves_the_callers_base_as_it_was(base_folder, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _saved(base_folder, tmp_path)
    tensors = load_file(folder / "adapter_model.safetensors")
    save_file({k: torch.tensor([float("nan")]) for k in tensors}, folder / "adapter_model.safetensors")
    base = _base(base_folder)
    with torch.no_grad():
        before = base(IDS).logits
    with pytest.raises(ValueError, match="does not fit the adapter's patch"):
        PeftModel.from_pretrained(base, folder)
    assert ht.get_config(base) is None and "peft_config" not in vars(base)
    with torch.no_grad():
        assert torch.equal(base(IDS).logits, before)


def test_transformers_adapter_switches_are_refused_or_kept_to_the_one_adapter(base_folder, tmp_path):
    folder = _saved(base_folder, tmp_path)
    model = _base(base_folder)
    model.load_adapter(str(folder))
    holder = next(m for m in model.modules() if type(m).__name__ == "GateHolder")
    with pytest.raises(ValueError, match=r"PeftModel.disable_adapter\(\) or hf_tangent.disabled\(model\)"):
        holder.enable_adapters(False)
    holder.set_adapter(["default"])
    with pytest.raises(ValueError, match="cannot be made active"):
        holder.set_adapter("other")
    with torch.no_grad():
        assert torch.isfinite(model(IDS).logits).all()


def test_low_cpu_mem_usage_loads(base_folder, tmp_path):
    folder = _saved(base_folder, tmp_path)
    with torch.no_grad():
        expected = PeftModel.from_pretrained(_base(base_folder), folder)(IDS).logits
        loaded = PeftModel.from_pretrained(_base(base_folder), folder, low_cpu_mem_usage=True)
        assert torch.equal(loaded(IDS).logits, expected)


def test_lora_on_a_tangent_peft_model_is_refused_by_save_patch(base_folder, tmp_path):
    from peft import LoraConfig

    nested = get_peft_model(_adapter(base_folder, update="projected"), LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="a PEFT model around a PEFT model"):
        ht.save_patch(nested, tmp_path / "p")
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("fields", [dict(homotopy={"lambda": 0.5, "schedul": "linear"}), dict(task_type="SEQ_CLS")])
def test_peft_s_reader_refuses_what_ht_s_refuses(fields):
    with pytest.raises(ValueError, match="TangentPeftConfig.(homotopy|task_type)="):
        ht.TangentPeftConfig(update="projected", **fields)
