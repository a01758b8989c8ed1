"""Offline (no network, or HF_HUB_OFFLINE set), every hf_tangent call that needs the Hub ends in one error of
hf_tangent's (artifacts/offline.py) that names the call, the Hub and what to do offline; errors that are not
about reaching the Hub pass unchanged. (The suite runs with HF_HUB_OFFLINE=1, conftest.py, and no connection
leaves the machine.)"""

import pytest
import torch

import hf_tangent as ht
from hf_tangent.artifacts.offline import HubUnavailableError, needs_hub

HUB = r"needs the Hugging Face Hub \(https://huggingface\.co\), which cannot be reached from here \((?P<why>.+?)\)\. Offline: "


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    from conftest import tiny_smollm2_llama

    folder = tmp_path_factory.mktemp("offline_base")
    model, tokenizer = tiny_smollm2_llama(folder)
    from transformers import LlamaForCausalLM

    model = ht.patch(LlamaForCausalLM.from_pretrained(folder), ht.TangentConfig(update="projected", gates=True))
    return model, tokenizer, folder


def offline_error(call, *, what: str, advice: str, why: str = "HF_HUB_OFFLINE is set"):
    with pytest.raises(HubUnavailableError, match=rf"^hf_tangent: {what} {HUB}") as err:
        call()
    text = str(err.value)
    assert why in text and advice in text.split("Offline: ", 1)[1], text
    return text


def test_push_patch_and_push_to_hub_offline(patched, tmp_path):
    """The Quick start's push offline ended in a raw httpx.ConnectError; with HF_HUB_OFFLINE in
    huggingface_hub's OfflineModeIsEnabled. The model and the user's files stay as they were."""
    model, tokenizer, _ = patched
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for call in (lambda: ht.push_patch(model, "user/x"), lambda: ht.push_to_hub(model, "user/x", tokenizer=tokenizer)):
        offline_error(call, what="pushing to the Hub repo 'user/x'", advice="ht.save_patch(model, 'my-patch')")
    ht.save_patch(model, tmp_path / "patch")
    offline_error(lambda: ht.push_patch(tmp_path / "patch", "user/x"), what="pushing to the Hub repo 'user/x'",
                  advice="push that folder from a machine with a network")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert sorted(p.name for p in (tmp_path / "patch").iterdir()) == ["README.md", "adapter_config.json",
                                                                      "adapter_model.safetensors"]


def test_push_without_a_network(patched, monkeypatch):
    """HF_HUB_OFFLINE unset: the connection itself fails (here, and on a machine without a network)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    text = offline_error(lambda: ht.push_patch(patched[0], "user/x"), what="pushing to the Hub repo 'user/x'",
                         advice="ht.save_patch", why="Error")
    assert "HF_HUB_OFFLINE is set" not in text


@pytest.mark.parametrize("kwargs", [{}, {"merge": True}, {"base_model": "/mirror/base"}], ids=["plain", "merge", "base_model"])
def test_from_pretrained_of_a_hub_id_offline(kwargs):
    """It said "user/x is not a saved model folder or hub repo"; with base_model= it said "a full model folder"."""
    offline_error(lambda: ht.from_pretrained("user/x", **kwargs), what=r"ht\.from_pretrained\('user/x'\)",
                  advice="load a local folder instead")


def test_the_advice_of_from_pretrained_is_true_for_that_call(monkeypatch):
    """Review of issue 47: HF_HUB_OFFLINE=1 ht.from_pretrained('smollm2-135m') advised "an offline model name
    (smollm2-135m, ...)", which only ht.load_model and --model take, and "a repo already in your cache loads with
    HF_HUB_OFFLINE=1 set" where it was set already: the repo is not in the cache."""
    from hf_tangent.artifacts import offline

    text = offline_error(lambda: ht.from_pretrained("smollm2-135m"), what=r"ht\.from_pretrained\('smollm2-135m'\)",
                         advice="load a local folder instead")
    advice = text.split("Offline: ", 1)[1]
    assert "offline model" not in advice and "gemma3-270m" not in advice, advice
    assert "is not in your Hugging Face cache" in advice and "loads with HF_HUB_OFFLINE=1 set" not in advice, advice
    monkeypatch.setattr(offline, "hub_offline", lambda: False)  # no network, HF_HUB_OFFLINE unset
    advice = str(offline.hub_error("ht.from_pretrained('user/x')", "load", "ConnectError: no route")).split(
        "Offline: ", 1)[1]
    assert "a repo already in your Hugging Face cache loads with HF_HUB_OFFLINE=1 set" in advice, advice


def test_a_patch_repo_whose_base_is_a_hub_id_offline(patched, tmp_path):
    ht.save_patch(patched[0], tmp_path / "patch", base_model="org/base-model")
    offline_error(lambda: ht.from_pretrained(tmp_path / "patch"), what=rf"ht\.from_pretrained\('{tmp_path}/patch'\)",
                  advice="base_model='/path/to/base'")


def test_load_model_export_and_datasets_offline(capsys):
    from hf_tangent import cli
    from hf_tangent.training.data import load_documents

    offline_error(lambda: ht.load_model("org/model"), what=r"the model 'org/model' \(not an offline name nor a local "
                  r"folder: a hub id\)", advice="name an offline model (smollm2-135m")
    offline_error(lambda: load_documents(dataset="wikitext-103"), what=r"the dataset 'wikitext-103' \(a hub dataset\)",
                  advice="--text-files")
    assert cli.main(["export", "--patch", "user/patch", "--output", "out"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hf-tangent export: error: hf_tangent: reading the patch repo 'user/patch' "
                                               "needs the Hugging Face Hub"), err


def test_the_documented_hub_command_line_ends_in_one_line(capsys):
    """docs/recipes.md's `hf-tangent calibrate --recipe calibrate --model gpt2 --dataset wikitext-103`, offline:
    exit 2, one line naming the Hub and what to do offline (the docs give `# offline: hf-tangent calibrate
    --recipe calibrate`)."""
    from hf_tangent import cli

    assert cli.main(["calibrate", "--recipe", "calibrate", "--model", "gpt2", "--dataset", "wikitext-103",
                     "--output_dir", "runs/never"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("hf-tangent calibrate: error: hf_tangent: ") and "needs the Hugging Face Hub" in err[-1]
    assert "Offline: " in err[-1]


def test_other_errors_pass_unchanged(tmp_path):
    with pytest.raises(ValueError, match="not about the Hub"), needs_hub("x", "load"):
        raise ValueError("not about the Hub")
    with pytest.raises(ValueError, match="no-such-folder is not a saved model folder or hub repo"):
        ht.from_pretrained(tmp_path / "no-such-folder")  # a path, not a hub id: hf_tangent's own error, as before
