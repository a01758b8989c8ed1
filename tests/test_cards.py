"""Model cards by the Hub's conventions (issue 57, item 5): `base_model` a Hub id, never a local path;
`library_name: hf_tangent`; tags hf_tangent and the rule."""

import pytest
from conftest import tiny_smollm2_llama
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM

import hf_tangent as ht
from hf_tangent.artifacts.hub import is_hub_id
from hf_tangent.core.install import PATCHED_BASE_NAME

HUB_ID = "HuggingFaceTB/SmolLM2-135M"


@pytest.mark.parametrize("name, expected", [
    (HUB_ID, True), ("gpt2", True), ("org/model.v2-x_y", True),
    ("", False), (None, False), ("smollm2-135m", False), ("gemma3-270m", False),  # offline names: no Hub repo
    ("/abs/folder", False), ("./folder", False), ("../up/folder", False), ("~/folder", False), ("a/b/c", False),
    ("C:\\models\\x", False), ("has space/x", False), (PATCHED_BASE_NAME, False),
])
def test_is_hub_id(name, expected):
    assert is_hub_id(name) is expected


def test_a_local_folder_and_an_existing_relative_path_are_no_hub_ids(tmp_path, monkeypatch):
    (tmp_path / "org" / "model").mkdir(parents=True)
    assert is_hub_id(str(tmp_path)) is False
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("org/model") is False and is_hub_id("org/other") is True


def saved_card(model, folder) -> tuple[dict, str]:
    ht.save_hub_folder(model, folder)
    card = ModelCard.load(folder / "README.md")
    return card.data.to_dict(), card.text


def test_the_card_of_a_local_base_names_no_base_model(tmp_path):
    tiny_smollm2_llama(tmp_path / "base")
    model = ht.patch(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), ht.TangentConfig(update="projected"))
    data, text = saved_card(model, tmp_path / "hub")
    assert data == {"library_name": "hf_tangent", "pipeline_tag": "text-generation",
                    "tags": ["hf_tangent", "hf_tangent-projected"]}
    assert "This is a local model (llama, `LlamaForCausalLM`) patched with" in text
    assert str(tmp_path) not in (tmp_path / "hub" / "README.md").read_text()


@pytest.mark.parametrize("name", ["smollm2-135m", ""])
def test_the_card_of_an_offline_or_unnamed_base_names_no_base_model(tmp_path, name):
    model = ht.patch(tiny_smollm2_llama()[0], ht.TangentConfig(update="soft", beta=0.5))
    model.config._name_or_path = name
    data, _ = saved_card(model, tmp_path / "hub")
    assert "base_model" not in data and data["tags"] == ["hf_tangent", "hf_tangent-soft"]


def test_the_card_of_a_hub_base_names_it_and_keeps_the_models_tags(tmp_path):
    model = ht.patch(tiny_smollm2_llama()[0], ht.TangentConfig(update="projected"))
    model.config._name_or_path = HUB_ID
    model.add_model_tags(["trl", "sft"])  # what TRL's trainers add; push_to_hub's and the Trainer's cards read them too
    data, text = saved_card(model, tmp_path / "hub")
    assert data == {"base_model": HUB_ID, "library_name": "hf_tangent", "pipeline_tag": "text-generation",
                    "tags": ["hf_tangent", "hf_tangent-projected", "trl", "sft"]}
    assert f"This is [`{HUB_ID}`](https://huggingface.co/{HUB_ID}) (llama, `LlamaForCausalLM`) patched with" in text
    assert model.model_tags == ["hf_tangent", "hf_tangent-projected", "trl", "sft"]  # what push_to_hub's card gets
