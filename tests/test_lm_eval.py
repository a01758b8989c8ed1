"""Downstream accuracy with lm-eval (hf-tangent lm-eval): the shipped Austen tasks, accuracy against an
independent greedy-match computation with plain transformers, variants against ht.disabled, the
paired interval against a hand-computed one, and plain `lm_eval` on a saved folder. Tiny models, a
few items; nothing is downloaded."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lm_eval")

import hf_tangent as ht  # noqa: E402
from hf_tangent.experiments.downstream import _paired  # noqa: E402
from hf_tangent.harness import run, tasks  # noqa: E402

LIMIT = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny Llama with SmolLM2's tokenizer and a context long enough for the task items."""
    from conftest import tiny_smollm2_llama

    model, tokenizer = tiny_smollm2_llama(max_positions=1024)
    with torch.no_grad():  # a model with preferences: random small weights give near-uniform predictions
        model.lm_head.weight.mul_(20)
    folder = tmp_path_factory.mktemp("tiny_lm_eval")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer, folder


def _items(task, n=LIMIT):
    with open(tasks.data_file(task), encoding="utf-8") as f:
        return [json.loads(next(f)) for _ in range(n)]


def test_the_shipped_tasks_regenerate_from_the_novels(tmp_path):
    from conftest import SHARED_AUSTEN

    if not SHARED_AUSTEN.is_dir():
        pytest.skip("the whole novels are in ../shared only")
    assert tasks.build(SHARED_AUSTEN, tmp_path) == {"austen_lastword": 1960, "austen_nextsentence": 2000}
    for task in tasks.TASKS:
        assert (tmp_path / f"{task}.jsonl").read_bytes() == tasks.data_file(task).read_bytes()
    item = _items("austen_nextsentence", 1)[0]
    assert len(item["choices"]) == 4 and 0 <= item["gold"] < 4 and item["novel"] in ("emma", "mansfieldpark")


def test_lastword_accuracy_against_greedy_match_with_plain_transformers():
    """On the real SmolLM2 weights (a random model never guesses a word): lm-eval's acc per item is the
    greedy match of the target's tokens, computed here with plain transformers."""
    from hf_tangent.models import load_model

    model, tokenizer = load_model("smollm2-135m")
    out = run.evaluate(model, tokenizer, ["austen_lastword"], run.task_manager(), limit=LIMIT)
    hits = []
    for doc_id, item in enumerate(_items("austen_lastword")):
        context = tokenizer(item["context"])["input_ids"]
        whole = tokenizer(item["context"] + " " + item["target"])["input_ids"]
        target = whole[len(context):]
        with torch.no_grad():
            logits = model(torch.tensor([whole[:-1]])).logits[0]
        greedy = logits[len(context) - 1:].argmax(-1).tolist()
        hits.append(float(greedy == target))
        assert out["samples"]["austen_lastword"][doc_id]["acc"] == hits[-1], doc_id
    assert out["results"]["austen_lastword"]["acc,none"] == pytest.approx(sum(hits) / len(hits))
    assert sum(hits) > 0  # the comparison is not all zeros


def test_variants_equal_the_model_under_disabled_and_the_patched_model(tiny):
    model, tokenizer, _ = tiny
    patched = ht.patch(__import__("copy").deepcopy(model), ht.TangentConfig(update="projected"))
    report = ht.lm_eval(patched, tokenizer, tasks=["austen_nextsentence"], variants=["unpatched", "projected"],
                        limit=LIMIT, bootstrap=200)
    with ht.disabled(patched):
        plain = run.evaluate(patched, tokenizer, ["austen_nextsentence"], run.task_manager(), limit=LIMIT)
    results = report["results"]
    assert results["unpatched"]["austen_nextsentence"] == plain["results"]["austen_nextsentence"]
    assert results["as given"] == results["projected"]  # the patched model as passed is the projected variant
    assert ht.get_config(patched).update == "projected"  # and it is left patched
    assert set(report["paired"]) == {"as given", "projected"}
    assert report["paired"]["projected"]["austen_nextsentence"]["acc"]["n"] == LIMIT


def test_the_paired_interval_against_a_hand_computed_one():
    """diffs (1, 1, 1, 0): the bootstrap mean takes 0, 1/4, ..., 1 with binomial(4, 3/4) weights; its
    2.5 % quantile is 1/4 (P(0) = 0.004 < 0.025 < P(<= 1/4) = 0.051) and its 97.5 % quantile is 1."""
    base = {"samples": {"t": {i: {"acc": 0.0} for i in range(4)}}}
    variant = {"samples": {"t": {0: {"acc": 1.0}, 1: {"acc": 1.0}, 2: {"acc": 1.0}, 3: {"acc": 0.0}}}}
    paired = _paired(variant, base, bootstrap=20000, seed=0)["t"]["acc"]
    assert (paired["diff"], paired["low"], paired["high"], paired["n"]) == (0.75, 0.25, 1.0, 4)


def test_plain_lm_eval_on_a_saved_folder_gives_the_same_accuracy(tiny, tmp_path):
    model, tokenizer, _ = tiny
    patched = ht.patch(__import__("copy").deepcopy(model), ht.TangentConfig(update="soft", beta=0.5))
    ht.save_hub_folder(patched, tmp_path / "folder", tokenizer=tokenizer)
    ours = ht.lm_eval(patched, tokenizer, tasks=["austen_lastword"], variants=["unpatched"],
                      limit=LIMIT, bootstrap=100)["results"]["as given"]["austen_lastword"]
    result = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
         f"pretrained={tmp_path / 'folder'},trust_remote_code=True,dtype=float32", "--device", "cpu",
         "--include_path", str(tasks.task_folder()), "--tasks", "austen_lastword", "--limit", str(LIMIT),
         "--output_path", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    written = next((tmp_path / "out").rglob("results_*.json"))
    theirs = json.loads(written.read_text())["results"]["austen_lastword"]
    assert theirs["acc,none"] == ours["acc,none"]
    assert theirs["perplexity,none"] == pytest.approx(ours["perplexity,none"], rel=1e-4)


def test_without_lm_eval_the_command_says_what_to_install_before_loading_a_model(monkeypatch, tmp_path, capsys):
    import importlib.util

    from hf_tangent import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    code = cli.main(["lm-eval", "--model", str(tmp_path / "no-such-model"), "--output_dir", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "pip install 'hf_tangent[eval]'" in err[0]


def test_lm_eval_refusals(tiny):
    model, tokenizer, _ = tiny
    with pytest.raises(ValueError, match="unknown variants \\['nope'\\]"):
        ht.lm_eval(model, tokenizer, variants=["nope"])
    with pytest.raises(ValueError, match="unknown lm-eval tasks \\['no_such_task'\\]"):
        ht.lm_eval(model, tokenizer, tasks=["no_such_task"])
    with pytest.raises(ValueError, match="limit=0 is out of range"):
        ht.lm_eval(model, tokenizer, limit=0)


def test_model_folders_take_full_folders_and_patch_repos(tiny, tmp_path):
    """A complete patched folder (save_pretrained) and a patch repo (save_patch) of the same gated model
    score exactly what the model in memory scores (the full folder used to be refused: merge= was
    passed for every folder, and full folders take no merge)."""
    model, tokenizer, folder = tiny
    from transformers import LlamaForCausalLM

    patched = ht.patch(LlamaForCausalLM.from_pretrained(folder).eval(), ht.TangentConfig(update="projected", gates=True))
    with torch.no_grad():
        ht.tangent_layers(patched)[1].gate.fill_(0.5)
    patched.save_pretrained(tmp_path / "full")
    ht.save_patch(patched, tmp_path / "patch", base_model=str(folder))
    report = ht.lm_eval(patched, tokenizer, tasks=["austen_lastword"], variants=["unpatched"], limit=LIMIT, bootstrap=50,
                        model_folders=[str(tmp_path / "full"), str(tmp_path / "patch")])
    results = report["results"]
    assert results[str(tmp_path / "full")] == results[str(tmp_path / "patch")] == results["as given"]
