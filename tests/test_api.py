"""The Python API of every recipe, called without argparse: typed arguments in, a Report out, whose
numbers agree with the library functions underneath (tested against independent computations in
their own test files)."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

import hf_tangent as ht
from hf_tangent.analysis import ablation, diagnostics, parallel
from hf_tangent.training.data import pack_windows


@pytest.fixture
def tiny(tiny_lm_folder):
    return LlamaForCausalLM.from_pretrained(tiny_lm_folder).eval(), AutoTokenizer.from_pretrained(tiny_lm_folder)


@pytest.fixture
def text(austen_dir):
    return ht.TextSource(text_files=(str(austen_dir / "emma.txt"),),
                         calibration_files=(str(austen_dir / "prideprejudice.txt"),))


def held_out(tokenizer, austen_dir, name="emma.txt", n=2):
    return pack_windows(tokenizer, [(austen_dir / name).read_text(encoding="utf-8")], 32, n)


def test_every_public_function_documents_its_arguments():
    for name in ht.__all__:
        obj = getattr(ht, name)
        if inspect.isfunction(obj):
            doc = inspect.getdoc(obj) or ""
            assert len(doc) > 40, name
            params = [p for p in inspect.signature(obj).parameters if p not in ("self", "kwargs", "fields")]
            if len(params) > 3 and name not in ("patch",):
                assert "Args:" in doc or all(p in doc for p in params[:2]), name


def test_evaluate_rules_on_a_model_object(tiny, text, austen_dir):
    model, tokenizer = tiny
    report = ht.evaluate_rules(model, tokenizer, text=text, rules=["projected"], seq_len=32, max_windows=2,
                               progress=False)
    assert isinstance(report, ht.Report) and report.kind == "eval"
    with torch.no_grad():
        windows = held_out(tokenizer, austen_dir)
        nll = sum(model(w[None], labels=w[None]).loss.item() for w in windows) / len(windows)
    rows = {r["variant"]: r for r in report["rows"]}
    assert rows["unpatched"]["nll"] == pytest.approx(nll, rel=1e-5)
    assert "| projected |" in report.to_markdown() and report.to_dict()["text"] == str(austen_dir / "emma.txt")
    assert ht.get_config(model) is None  # the caller's model is left as it was


def test_evaluate_rules_keeps_the_callers_patch(tiny, austen_dir):
    model, tokenizer = tiny
    ht.patch(model, ht.TangentConfig(update="zero", layers=[0]))
    docs = [(austen_dir / "emma.txt").read_text(encoding="utf-8")]
    report = ht.evaluate_rules(model, tokenizer, text=docs, rules=[], seq_len=32, max_windows=1, progress=False)
    assert [r["variant"] for r in report["rows"]] == ["unpatched", "saved patch (as loaded)"]
    assert ht.get_config(model).update == "zero" and report["text"] == "user documents"


def test_ablate_diagnose_sensitivity_agree_with_the_library(tiny, text, austen_dir):
    model, tokenizer = tiny
    windows = held_out(tokenizer, austen_dir)
    report = ht.ablate(model, tokenizer, text=text, variants=["zero_ffn"], bootstrap=50, seq_len=32, max_windows=2,
                       progress=False)
    direct = ablation.run_ablation(model, windows, variants=["zero_ffn"], n_boot=50)
    assert report["rows"] == direct["rows"] and report["full_loss"] == direct["full_loss"]
    with pytest.raises(ValueError, match=r"bootstrap=0 is out of range; accepted: an integer >= 1"):
        ht.ablate(model, tokenizer, text=text, bootstrap=0, progress=False)
    report = ht.diagnose_layers(model, tokenizer, text=text, update="projected", seq_len=32, max_windows=2, progress=False)
    assert report["layers"][1]["orthogonality_error"]["max"] < 1e-4
    assert ht.get_config(model) is None  # the analysis patched the model it was given, and took the patch off again
    assert report["layers"][0]["rho"] == pytest.approx(diagnostics.diagnose(
        ht.patch(model, ht.TangentConfig(update="projected")), windows)[0]["rho"])
    ht.unpatch(model)
    report = ht.layer_sensitivity(model, tokenizer, text=text, seq_len=32, max_windows=2, progress=False)
    calibration = held_out(tokenizer, austen_dir, "prideprejudice.txt")
    assert report["scores"] == parallel.sensitivity(model, calibration)["scores"]
    assert report["text"] == str(austen_dir / "prideprejudice.txt")


def test_parallel_sweep_api(tiny, text):
    model, tokenizer = tiny
    report = ht.parallel_sweep(model, tokenizer, text=text, calibration_windows=1, ks=[0, 1], random_seeds=[0],
                               greedy=False, speed=False, seq_len=32, max_windows=1, progress=False)
    assert report.kind == "parallel-sweep" and report["sweep"]["curves"]["low_c"][0] == 0.0
    assert report["speed"] is None and list(report["recommendations"]) == ["low_c"]


def test_every_public_name_keeps_its_type_and_none_is_a_module_name():
    """`ht.heal` was the lazily loaded function on first access and the module hf_tangent/heal.py on every
    later one (importing the recipe set the submodule as the package attribute). In a fresh process:
    no public name is also a submodule's name, and walking __all__ twice gives the same objects."""
    import subprocess
    import sys

    script = (
        "import hf_tangent as ht, pkgutil, types\n"
        "modules = {m.name for m in pkgutil.iter_modules(ht.__path__)}\n"
        "clash = sorted(set(ht.__all__) & modules)\n"
        "assert not clash, clash\n"
        "first = {n: getattr(ht, n) for n in ht.__all__}\n"
        "second = {n: getattr(ht, n) for n in ht.__all__}\n"
        "changed = [n for n in ht.__all__ if first[n] is not second[n]]\n"
        "assert not changed, changed\n"
        "assert not [n for n, o in second.items() if isinstance(o, types.ModuleType)]\n"
        "assert callable(ht.heal) and callable(ht.heal)\n"
        "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def _entry_points_kwargs(tmp_path):
    """Small settings for every experiment entry point (hf_tangent/experiments), by name."""
    from hf_tangent.experiments.finetune import FinetuneTrainingArguments
    from hf_tangent.experiments.heal import HealTrainingArguments

    small = dict(seq_len=16, max_windows=1)
    one_step = dict(max_steps=1, use_cpu=True, per_device_train_batch_size=1, per_device_eval_batch_size=1)
    return {
        "evaluate_rules": dict(rules=["projected"], **small),
        "calibrate_gates": dict(training_args=ht.TangentTrainingArguments(output_dir=str(tmp_path / "c"), **one_step),
                                train_windows=1, **small),
        "finetune": dict(rules=["projected"], seeds=[0], train_windows=1, method="full",
                         training_args=FinetuneTrainingArguments(output_dir=str(tmp_path / "f"), **one_step), **small),
        "heal": dict(settings=ht.HealSettings(method="full", homotopy_fraction=0.0), train_windows=1, max_new_tokens=1,
                     training_args=HealTrainingArguments(output_dir=str(tmp_path / "h"), **one_step), **small),
        "ablate": dict(variants=["full", "zero_ffn"], bootstrap=10, **small),
        "diagnose_layers": dict(**small),
        "layer_sensitivity": dict(**small),
        "parallel_sweep": dict(ks=[0, 1], random_seeds=[0], greedy=False, speed=False, calibration_windows=1, **small),
        "critical": dict(layers=[0], fields=["attention"], random_starts=2, token_starts=0, steps=2, **small),
        "pressure": dict(factors=[0.5], variants=["full"], **small),
        "ffn_jacobian": dict(layers=[0], tokens=2, **small),
        "lm_eval": dict(tasks=["austen_lastword"], variants=["unpatched"], limit=2, bootstrap=10),
    }


ENTRY_POINTS = [n for n, module in ht._LAZY.items() if module == "experiments" and n[0].islower()]


def _state(model):
    """Everything a call could change on a model: logits, hooks, record, gates, lambda, flags."""
    import json

    ids = torch.arange(8)[None] % model.config.vocab_size
    with torch.no_grad():
        logits = model(ids).logits
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    gates = [c.gate.detach().clone() for c in ht.tangent_layers(model) if c.gate is not None]
    return (logits, hooks, json.dumps(getattr(model.config, "hf_tangent", None), sort_keys=True, default=str),
            [g.tolist() for g in gates], ht.get_homotopy(model), [m.training for m in model.modules()],
            [p.requires_grad for p in model.parameters()], type(model.config))


def _same(a, b):
    return torch.equal(a[0], b[0]) and a[1:] == b[1:]


def test_the_entry_point_list_is_complete(tmp_path):
    assert sorted(_entry_points_kwargs(tmp_path)) == sorted(ENTRY_POINTS)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_every_entry_point_leaves_a_patched_model_as_it_was(name, tiny, text, tmp_path):
    """Refused with one clear error, or run on the model as it is; either way the caller's patch,
    gates, lambda and training flags come back bit-identical (`ht.pressure` used to delete them)."""
    model, tokenizer = tiny
    ht.patch(model, ht.TangentConfig(update="projected", gates=True))
    with torch.no_grad():
        ht.tangent_layers(model)[0].gate.fill_(0.75)
    ht.set_homotopy(model, 0.4)
    model.train()
    before = _state(model)
    function = getattr(ht, name)
    args = (ht.TangentConfig(update="projected"),) if name == "heal" else ()
    if name in ("evaluate_rules", "diagnose_layers"):  # analysed as they are
        function(model, *args, tokenizer=tokenizer, text=text, progress=False, **_entry_points_kwargs(tmp_path)[name])
    elif name == "lm_eval":  # scored as given, next to the variants (its own text: the Austen tasks)
        function(model, tokenizer=tokenizer, **_entry_points_kwargs(tmp_path)[name])
    else:
        with pytest.raises(ValueError, match=rf"hf_tangent.{name} works on the unpatched model, and this model is patched"):
            function(model, *args, tokenizer=tokenizer, text=text, **_entry_points_kwargs(tmp_path)[name])
    assert _same(before, _state(model))


@pytest.mark.parametrize("name", [n for n in ENTRY_POINTS if n != "calibrate_gates"])  # documented: trains in place
def test_every_entry_point_leaves_an_unpatched_model_unpatched(name, tiny, text, tmp_path):
    model, tokenizer = tiny
    model.model.layers[0].train()
    before = _state(model)
    kwargs = _entry_points_kwargs(tmp_path)[name]
    if name == "diagnose_layers":  # patches the model with the variant for the analysis
        kwargs = kwargs | {"update": "projected"}
    args = (ht.TangentConfig(update="projected"),) if name == "heal" else ()
    if name == "lm_eval":  # its own text (the Austen tasks), no progress option
        ht.lm_eval(model, tokenizer=tokenizer, **kwargs)
    else:
        kwargs |= {} if name in ("finetune", "heal", "calibrate_gates") else {"progress": False}
        getattr(ht, name)(model, *args, tokenizer=tokenizer, text=text, **kwargs)
    assert _same(before, _state(model))
