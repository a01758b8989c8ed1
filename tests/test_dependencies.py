"""Issue 59 item 7: a user who only patches and loads installs torch, transformers, accelerate (peft imports it),
peft and safetensors. Without the `recipes` extra (datasets, gguf, rdata, evaluate, matplotlib) patching, saving
and loading work exactly; a recipe that needs the extra says so in one line that names it.

The extra is taken away for real in a fresh process: its site-packages is a folder of links to this environment's
entries less the extra's packages and their metadata, so imports and transformers' is_*_available both miss them."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

RECIPES = ("datasets", "gguf", "rdata", "evaluate", "matplotlib")

_PRELUDE = r"""
import importlib.util, site, sys
site.addsitedir(sys.argv[1])
assert [name for name in {recipes!r} if importlib.util.find_spec(name) is not None] == []  # the extra is gone
"""

_PATCH_SAVE_LOAD = r"""
from pathlib import Path
import torch
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM
import hf_tangent as ht
base_folder, out = sys.argv[2], Path(sys.argv[3])
ids = torch.tensor([[1, 5, 9, 33, 2, 17, 40]])

def base():
    return AutoModelForCausalLM.from_pretrained(base_folder).eval()

def logits(model):
    with torch.no_grad():
        return model(ids).logits

def set_gates(model):  # away from 1: their values must be saved and loaded too
    with torch.no_grad():
        for i, child in enumerate(ht.tangent_layers(model)):
            child.gate.fill_(0.6 + 0.3 * i)
    return model

model = base()
plain = logits(model)
model = ht.patch(model, ht.TangentConfig(update="projected", gates=True))
live = logits(set_gates(model))
assert not torch.equal(live, plain)  # the patch changes the model: equal logits below mean it was loaded
ht.save_patch(model, out / "patch")
model.save_pretrained(out / "full")
for folder in ("patch", "full"):
    assert torch.equal(logits(ht.from_pretrained(out / folder)), live), folder
assert torch.equal(logits(ht.unpatch(model)), plain)
adapter = get_peft_model(base(), ht.TangentPeftConfig(update="retract", p=2.0, gates=True, task_type="CAUSAL_LM"))
live = logits(set_gates(adapter))
adapter.save_pretrained(out / "adapter")
assert torch.equal(logits(PeftModel.from_pretrained(base(), out / "adapter")), live)
assert not any(name.split(".")[0] in {recipes!r} for name in sys.modules)
print("ok")
"""

_CLI = r"""
from hf_tangent import cli
sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.fixture(scope="module")
def without_recipes(tmp_path_factory) -> Path:
    """A site-packages folder: this environment's entries less the `recipes` extra's packages and metadata."""
    site = tmp_path_factory.mktemp("site-packages")
    for lib in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        for entry in os.listdir(lib):  # datasets/, datasets-5.2.0.dist-info, ...
            if entry.split("-")[0].split(".")[0].lower() not in RECIPES and not (site / entry).exists():
                (site / entry).symlink_to(Path(lib) / entry)
    return site


def _run(script: str, *args) -> subprocess.CompletedProcess:
    # -S: not this environment's site-packages, only the linked one (its .pth files, the editable install's too)
    return subprocess.run([sys.executable, "-S", "-c", _PRELUDE.format(recipes=RECIPES) + script, *map(str, args)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_patch_save_and_load_are_exact_without_the_recipes_extra(without_recipes, tiny_lm_folder, tmp_path):
    result = _run(_PATCH_SAVE_LOAD.format(recipes=RECIPES), without_recipes, tiny_lm_folder, tmp_path)
    assert result.returncode == 0 and result.stdout.splitlines()[-1:] == ["ok"], result.stderr[-4000:]


def test_a_recipe_without_the_extra_names_it_in_one_line(without_recipes, tiny_lm_folder, tmp_path):
    (tmp_path / "text.txt").write_text("It is a truth universally acknowledged.\n", encoding="utf-8")
    result = _run(_CLI, without_recipes, "calibrate", "--model", tiny_lm_folder, "--text_files", tmp_path / "text.txt",
                  "--output_dir", tmp_path / "out")
    assert result.returncode == 2, result.stderr[-4000:]
    assert result.stderr.splitlines()[-1] == (
        "hf-tangent calibrate: error: hf_tangent: loading text documents needs the `recipes` extra (datasets is not "
        "installed): pip install 'hf_tangent[recipes]'")
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_an_offline_model_without_the_extra_names_it_in_one_line(without_recipes, tmp_path):
    """The offline weights are converted once from GGUF: with a cold cache and no gguf, the command says which
    extra to install (it gave transformers' 'Please install ... gguf' traceback before)."""
    result = subprocess.run(
        [sys.executable, "-S", "-c", _PRELUDE.format(recipes=RECIPES) + _CLI, without_recipes, "eval", "--model",
         "smollm2-135m", "--output_dir", tmp_path / "out"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_TANGENT_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 2, result.stderr[-4000:]
    assert result.stderr.splitlines()[-1] == (
        "hf-tangent eval: error: hf_tangent: the offline model 'smollm2-135m' is converted once from GGUF, which "
        "needs the `recipes` extra (gguf is not installed): pip install 'hf_tangent[recipes]'")
