"""The mixed corpus in the recipes (the corpus itself: test_corpora.py; heal's per-domain report:
test_heal.py): eval's per-domain table against an independent NLL on the same windows, and the
recipes that read one text refusing it (a pooled list would fill every window with the first domain)."""

import json

import pytest
import torch
from conftest import nll_with_ffn_rule

import hf_tangent as ht
from hf_tangent import cli
from hf_tangent.training import corpora
from hf_tangent.training.data import TextSource, pack_windows


def test_eval_reports_every_held_out_domain_against_an_independent_nll(tiny_lm_folder, tmp_path):
    from test_patching import expected_delta
    from transformers import LlamaForCausalLM

    from hf_tangent.artifacts.models import load_tokenizer

    out = tmp_path / "eval"
    assert cli.main(["eval", "--model", str(tiny_lm_folder), "--corpus", "mixed", "--updates", "projected",
                     "--seq_len", "32", "--max_windows", "2", "--output_dir", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert list(report["domains"]) == list(corpora.DOMAINS) and report["windows"] == 2 * len(corpora.DOMAINS)
    tokenizer = load_tokenizer(str(tiny_lm_folder))
    model = LlamaForCausalLM.from_pretrained(tiny_lm_folder).eval()
    rule = ht.TangentConfig(update="projected")
    pooled = {"unpatched": [], "projected": []}
    for name in corpora.DOMAINS:
        windows = pack_windows(tokenizer, corpora.domain_documents(name, "heldout"), 32, 2)
        base = [nll_with_ffn_rule(model, w[None]) for w in windows]
        patched = [nll_with_ffn_rule(model, w[None], lambda x, y, i: expected_delta(rule, x, y)) for w in windows]
        pooled["unpatched"] += base
        pooled["projected"] += patched
        rows = {r["variant"]: r for r in report["domains"][name]["rows"]}
        assert rows["unpatched"]["nll"] == pytest.approx(sum(base) / 2, rel=1e-5)
        d = rows["projected"]
        assert d["delta_nll"] == pytest.approx((sum(patched) - sum(base)) / 2, abs=1e-4)
        assert d["low"] <= d["delta_nll"] <= d["high"]
    rows = {r["variant"]: r for r in report["rows"]}
    for variant, values in pooled.items():  # the pooled table is the mean over every domain's windows
        assert rows[variant]["nll"] == pytest.approx(sum(values) / len(values), rel=1e-5)
    assert "window_nll" not in rows["unpatched"]
    markdown = (out / "report.md").read_text()
    assert "| python | 2 | projected |" in markdown


def test_the_default_eval_is_unchanged_one_text_and_no_domain_table(tiny_lm_folder, tmp_path):
    out = tmp_path / "eval"
    assert cli.main(["eval", "--model", str(tiny_lm_folder), "--updates", "projected", "--seq_len", "32",
                     "--max_windows", "2", "--output_dir", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert "domains" not in report and report["text"] == "austen:evaluation" and report["windows"] == 2


@pytest.mark.parametrize("recipe", ["ablate", "diagnose_layers", "layer_sensitivity"])
def test_recipes_that_read_one_text_refuse_the_mixed_corpus(tiny_lm_folder, recipe):
    from transformers import LlamaForCausalLM

    from hf_tangent.artifacts.models import load_tokenizer

    model = LlamaForCausalLM.from_pretrained(tiny_lm_folder).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="corpus='mixed' is one text per domain, windowed domain by domain; this recipe "
                                         "reads one text"):
        getattr(ht, recipe)(model, load_tokenizer(str(tiny_lm_folder)), text=TextSource(corpus="mixed"), seq_len=32,
                            max_windows=2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert ht.get_config(model) is None


def test_domain_summary_checks_its_counts_and_gives_no_interval_for_one_window():
    from hf_tangent.experiments.heal import domain_summary, heal_markdown  # noqa: F401

    runs = [{"seed": 0, "untrained": {"window_nll": [2.0, 3.0, 5.0]}, "healed": {"window_nll": [1.5, 2.5, 4.0]}}]
    with pytest.raises(ValueError, match="do not add up to the 3 windows scored"):
        domain_summary(runs, [1.0, 2.0, 4.0], {"a": 1, "b": 9})
    out = domain_summary(runs, [1.0, 2.0, 4.0], {"a": 1, "b": 2}, bootstrap=200)
    assert out["a"]["runs"][0]["healed"] == {"nll": 1.5, "delta_nll": 0.5, "low": None, "high": None}
    b = out["b"]["runs"][0]["untrained"]
    assert b["delta_nll"] == pytest.approx(1.0) and b["nll"] == pytest.approx(4.0) and b["low"] <= 1.0 <= b["high"]
    assert out["b"]["unpatched_nll"] == pytest.approx(3.0)


def test_domain_windows_name_the_domain_and_share_the_training_windows(tiny_lm_folder):
    from transformers import LlamaForCausalLM

    from hf_tangent.artifacts.models import load_tokenizer
    from hf_tangent.experiments.common import domain_windows, spread

    model, tokenizer = LlamaForCausalLM.from_pretrained(tiny_lm_folder), load_tokenizer(str(tiny_lm_folder))
    long = " ".join(["the quiet river runs past the old mill"] * 40)
    with pytest.raises(ValueError, match="fewer than one window of seq_len=32.*\\(domain 'short'\\)"):
        domain_windows(model, tokenizer, {"long": [long], "short": ["two words"]}, 32, 4)
    with pytest.raises(ValueError, match="3 windows cannot be shared by the 4 domains"):
        domain_windows(model, tokenizer, {k: [long] for k in "abcd"}, 32, 3, split=True)
    shared = domain_windows(model, tokenizer, {k: [long] for k in "abc"}, 32, 7, split=True)
    assert [len(w) for w in shared.values()] == [3, 2, 2]
    probe = spread(shared, 4)  # round-robin: a0 b0 c0 a1
    assert torch.equal(probe, torch.stack([shared["a"][0], shared["b"][0], shared["c"][0], shared["a"][1]]))
    assert torch.equal(spread({"one": shared["a"]}, 2), shared["a"][:2])


def test_mixed_corpus_training_windows_are_checked_before_a_model_loads(tmp_path):
    with pytest.raises(ValueError, match="train_windows=5 cannot be shared by the 6 domains of the mixed corpus"):
        ht.heal(str(tmp_path / "no-such-model"), ht.TangentConfig(update="projected"), train_windows=5)


def test_corpus_api_refuses_hostile_domains_and_an_incomplete_cache(tmp_path, monkeypatch):
    for domains, message in (([], "a non-empty list of distinct names"), (["python", "python"], "distinct names"),
                             (3, "must be a list of domain names"), ("austen", "not the string 'austen'")):
        with pytest.raises(ValueError, match=message):
            corpora.mixed_documents("train", domains)
    with pytest.raises(ValueError, match="unknown corpus domain \\['python'\\]"):
        corpora.domain_documents(["python"], "train")
    monkeypatch.delenv("HF_TANGENT_CORPUS_DIR")
    monkeypatch.setenv("HF_TANGENT_CACHE", str(tmp_path))
    partial = tmp_path / "corpus" / corpora.CORPUS_VERSION / "python" / "train"
    partial.mkdir(parents=True)
    (partial / "x.txt").write_text("some text", encoding="utf-8")
    with pytest.raises(FileNotFoundError, match="is incomplete \\(no documents for python/heldout, gnu/train"):
        corpora.corpus_dir()
    assert (partial / "x.txt").read_text(encoding="utf-8") == "some text"


def test_eval_of_a_healed_patch_repo_compares_with_the_base_not_the_adapted_weights(tiny_lm_folder, tmp_path):
    """A patch repo with LoRA adapters loads as a PeftModel: its "unpatched" row used to be the model with
    the rule off but the adapters on (so a heal looked better or worse than it was); it is the base now,
    checked against the base's own NLL on the same windows, and the report says what the row is."""
    from transformers import LlamaForCausalLM

    from hf_tangent.artifacts.models import load_tokenizer

    common = ["--model", str(tiny_lm_folder), "--seq-len", "32", "--max-windows", "2", "--max-steps", "3",
              "--per-device-train-batch-size", "4", "--update", "projected", "--train-windows", "12",
              "--learning-rate", "0.05", "--save-models", "true", "--output-dir", str(tmp_path / "heal")]
    assert cli.main(["heal", *common]) == 0
    repo = tmp_path / "heal" / "runs" / "seed0" / "patch"
    assert cli.main(["eval", "--model", str(repo), "--corpus", "mixed", "--updates", "unpatched", "--seq_len", "32",
                     "--max_windows", "2", "--output_dir", str(tmp_path / "eval")]) == 0
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["unpatched_is"] == "the base model (the patch repo's adapters off)"
    tokenizer = load_tokenizer(str(tiny_lm_folder))
    base = LlamaForCausalLM.from_pretrained(tiny_lm_folder).eval()
    healed = ht.from_pretrained(str(repo), merge=True).eval()
    heal = json.loads((tmp_path / "heal" / "report.json").read_text())
    for name in corpora.DOMAINS:
        windows = pack_windows(tokenizer, corpora.domain_documents(name, "heldout"), 32, 2)
        rows = {r["variant"]: r for r in report["domains"][name]["rows"]}
        assert rows["unpatched"]["nll"] == pytest.approx(sum(nll_with_ffn_rule(base, w[None]) for w in windows) / 2,
                                                         rel=1e-5)
        with torch.no_grad():
            own = sum(healed(w[None], labels=w[None]).loss.item() for w in windows) / 2
        assert rows["saved patch (as loaded)"]["nll"] == pytest.approx(own, rel=1e-4)
        # the same figures as the heal's own per-domain report
        assert rows["saved patch (as loaded)"]["delta_nll"] == pytest.approx(
            heal["domains"][name]["runs"][0]["healed"]["delta_nll"], abs=1e-4)
