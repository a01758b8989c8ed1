"""LoRA (any PEFT adapter) trained on a patched model never loads silently onto the unpatched base (issue 57, item 3).

A patched model names PATCHED_BASE_NAME as its base (`model.name_or_path`), so every adapter PEFT saves from it,
directly or through TRL's SFTTrainer and its checkpoints, names that text as its base: the loaders that read the base
from the adapter (AutoPeftModelForCausalLM, transformers' adapter loading, pipeline) refuse it with the text in their
error, and PeftModel.from_pretrained on the base patched as in training gives the live logits."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import tiny_smollm2_llama
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

import hf_tangent as ht
from hf_tangent.core.install import PATCHED_BASE_NAME

CONFIG = ht.TangentConfig(update="projected", layers=[0])
# huggingface_hub's own refusal of a name that is no folder and no repo id, before any request
REFUSAL = ("Repo id must use alphanumeric chars, '-', '_' or '.'. The name cannot start or end with '-' or '.' and the "
           f"maximum length is 96: '{PATCHED_BASE_NAME}'.")


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("base")
    tiny_smollm2_llama(folder)
    return folder


def lora_on_patch(base_folder):
    """A LoRA on the patched base whose B is random (PEFT starts B at 0, a no-op adapter)."""
    patched = ht.patch(AutoModelForCausalLM.from_pretrained(base_folder), CONFIG)
    torch.manual_seed(3)
    return get_peft_model(patched, LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))


def tokens():
    return torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(1))


def test_the_marker_is_one_short_line_that_says_how_to_load():
    assert "\n" not in PATCHED_BASE_NAME and len(PATCHED_BASE_NAME) <= 240
    for how in ("PeftModel.from_pretrained(hf_tangent.patch(base, training_cfg), folder)",
                "hf_tangent.save_patch(peft_model, folder)", "hf_tangent.from_pretrained(folder)"):
        assert how in PATCHED_BASE_NAME


_LOADERS = """
import json, socket, sys
tried = []
def refuse(sock, address):
    tried.append(repr(address))
    raise OSError("no network in this test")
socket.socket.connect = refuse
from peft import AutoPeftModelForCausalLM
from transformers import AutoModelForCausalLM, pipeline
folder, errors = sys.argv[1], {}
for name, load in [("AutoPeftModelForCausalLM", lambda: AutoPeftModelForCausalLM.from_pretrained(folder)),
                   ("AutoModelForCausalLM", lambda: AutoModelForCausalLM.from_pretrained(folder)),
                   ("pipeline", lambda: pipeline("text-generation", model=folder))]:
    try:
        load()
        errors[name] = None
    except Exception as err:
        errors[name] = [type(err).__name__, str(err)]
print(json.dumps({"errors": errors, "tried": tried, "hf_tangent": any(m.startswith("hf_tangent") for m in sys.modules)}))
"""


def test_an_adapter_saved_from_a_patched_model_is_refused_by_the_loaders_that_read_its_base(base_folder, tmp_path):
    """Before: adapter_config.json named the base folder, and all three loaders put the LoRA on the unpatched base."""
    peft_model = lora_on_patch(base_folder)
    peft_model.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == PATCHED_BASE_NAME
    # a fresh process that never imports hf_tangent, the Hub not switched off: refused, no connection tried
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    result = subprocess.run([sys.executable, "-c", _LOADERS, str(tmp_path / "adapter")], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["tried"] == [] and seen["hf_tangent"] is False
    assert seen["errors"] == {name: ["OSError", REFUSAL] for name in ("AutoPeftModelForCausalLM", "AutoModelForCausalLM",
                                                                      "pipeline")}


def test_the_adapter_on_the_base_patched_as_in_training_gives_the_live_logits(base_folder, tmp_path):
    peft_model = lora_on_patch(base_folder).eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        live = peft_model(tokens()).logits
        fresh = AutoModelForCausalLM.from_pretrained(base_folder)
        unpatched = PeftModel.from_pretrained(fresh, tmp_path / "adapter")(tokens()).logits  # what the loaders gave before
        fresh = AutoModelForCausalLM.from_pretrained(base_folder)
        loaded = PeftModel.from_pretrained(ht.patch(fresh, CONFIG), tmp_path / "adapter")(tokens()).logits
    assert torch.equal(loaded, live)
    assert (unpatched - live).abs().max() > 1e-3  # float noise is ~1e-6: the unpatched load gives other logits


def test_patch_names_the_marker_and_tags_and_unpatch_restores_them_exactly(base_folder):
    model = AutoModelForCausalLM.from_pretrained(base_folder)
    assert model.name_or_path == str(base_folder) and "model_tags" not in vars(model)
    ht.patch(model, CONFIG)
    assert model.name_or_path == PATCHED_BASE_NAME and model.model_tags == ["hf_tangent", "hf_tangent-projected"]
    assert model.config._name_or_path == str(base_folder)  # what savers and cards read: the base's
    with ht.disabled(model):
        assert model.name_or_path == str(base_folder) and "model_tags" not in vars(model)
    assert model.name_or_path == PATCHED_BASE_NAME
    ht.update_config(model, update="soft", beta=0.5)  # a new rule: its tag replaces the old one
    assert model.model_tags == ["hf_tangent", "hf_tangent-soft"]
    ht.unpatch(model)
    assert vars(model)["name_or_path"] == str(base_folder) and "model_tags" not in vars(model)
    assert model.model_tags is None  # the class's own value again

    del model.name_or_path  # absent before the patch: absent after
    model.add_model_tags(["mine", "hf_tangent"])
    ht.patch(model, CONFIG)
    assert model.model_tags == ["mine", "hf_tangent", "hf_tangent-projected"]
    model.add_model_tags("trl")  # a tag added while patched (TRL's) stays; only the patch's own go
    ht.unpatch(model)
    assert "name_or_path" not in vars(model) and model.model_tags == ["mine", "hf_tangent", "trl"]


def test_sft_trainer_lora_checkpoints_and_final_save_name_the_marker(base_folder, tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from hf_tangent.artifacts.models import load_tokenizer

    patched = ht.patch(AutoModelForCausalLM.from_pretrained(base_folder), CONFIG)
    data = Dataset.from_dict({"text": ["It is a truth universally acknowledged, that a single man in possession"] * 4})
    args = SFTConfig(output_dir=str(tmp_path / "out"), max_steps=2, save_steps=1, report_to=[], use_cpu=True,
                     per_device_train_batch_size=2, max_length=16)
    trainer = SFTTrainer(model=patched, args=args, train_dataset=data, processing_class=load_tokenizer("smollm2-135m"),
                         peft_config=LoraConfig(r=2, target_modules=["q_proj"]))
    trainer.train()
    trainer.save_model()
    out = tmp_path / "out"
    for folder in (out / "checkpoint-1", out / "checkpoint-2", out):
        assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == PATCHED_BASE_NAME
    card = (out / "README.md").read_text()  # PEFT's card: the patched model's tags, TRL's beside them
    assert {"hf_tangent", "hf_tangent-projected", "trl", "sft"} <= set(_front_matter(card)["tags"])


def _front_matter(card: str) -> dict:
    from huggingface_hub import ModelCard

    return ModelCard(card).data.to_dict()


def test_a_patched_folder_loaded_back_names_the_marker_too(base_folder, tmp_path):
    """ht.from_pretrained and the folder's remote code patch in __init__: the loaded model is marked as well."""
    ht.patch(AutoModelForCausalLM.from_pretrained(base_folder), CONFIG).save_pretrained(tmp_path / "patched")
    for model in (ht.from_pretrained(tmp_path / "patched"),
                  AutoModelForCausalLM.from_pretrained(tmp_path / "patched", trust_remote_code=True)):
        assert model.name_or_path == PATCHED_BASE_NAME
        assert model.config._name_or_path == str(tmp_path / "patched")

