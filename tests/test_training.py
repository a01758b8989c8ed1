"""Trainer recipes on a tiny Llama with the real tokenizer: gate calibration, resume, 2 processes,
fine-tuning statistics, the evaluate metric, recipes, Hub folder and remote code."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_tangent as ht
from hf_tangent import cli
from hf_tangent.analysis.evaluation import PERPLEXITY_METRIC, perplexity, strided_perplexity
from hf_tangent.artifacts.models import load_tokenizer
from hf_tangent.training import trainer as training
from hf_tangent.training.data import pack_windows


def calibrate(folder, out, austen_dir, *, compare=(), save_model=True, save_patch=True, **training_fields):
    """ht.calibrate_gates on the tiny model, its report saved to `out` and read back from there."""
    fields = dict(output_dir=str(out), max_steps=6, learning_rate=0.02, per_device_train_batch_size=8,
                  per_device_eval_batch_size=8, use_cpu=True) | training_fields
    text = ht.TextSource(text_files=(str(austen_dir / "emma.txt"),),
                         calibration_files=(str(austen_dir / "prideprejudice.txt"),))
    report = ht.calibrate_gates(str(folder), text=text, seq_len=32, max_windows=4, train_windows=8,
                                compare_rules=list(compare), training_args=ht.TangentTrainingArguments(**fields),
                                save_model=out / "model" if save_model else None,
                                save_patch=out / "patch" if save_patch else None, progress=False)
    report.save(out)
    return json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def calibrated(tiny_lm_folder, tmp_path_factory):
    from conftest import AUSTEN

    out = tmp_path_factory.mktemp("calibrated")
    return calibrate(tiny_lm_folder, out, AUSTEN, compare=["projected"]), out


def test_gate_calibration_moves_gates_and_lowers_calibration_loss(calibrated):
    report, _ = calibrated
    gates = report["gates"]
    assert len(gates) == 2 and all(abs(g - 1.0) > 1e-3 for g in gates.values())
    assert report["calibration"]["gated_nll"] < report["calibration"]["natural_nll"]
    s = report["gate_summary"]
    assert (s["min"], s["mean"], s["max"]) == pytest.approx((min(gates.values()), sum(gates.values()) / 2,
                                                             max(gates.values())))
    assert [r["variant"] for r in report["update_variants"]] == ["unpatched", "projected"]


def test_calibration_report_against_an_independent_evaluation(calibrated, tiny_lm_folder, austen_dir):
    """The held-out figures of the report, recomputed with the gates and the projection written as
    plain torch hooks on the unpatched model (conftest.nll_with_ffn_rule)."""
    from conftest import nll_with_ffn_rule, projected

    report, _ = calibrated
    model = AutoModelForCausalLM.from_pretrained(tiny_lm_folder).eval()
    text = (austen_dir / "emma.txt").read_text(encoding="utf-8")
    windows = pack_windows(load_tokenizer(str(tiny_lm_folder)), [text], 32, 4)
    gates = {int(k): v for k, v in report["gates"].items()}
    natural = nll_with_ffn_rule(model, windows)
    gated = nll_with_ffn_rule(model, windows, lambda x, y, i: gates[i] * y)
    h = report["heldout"]
    assert (h["natural_nll"], h["gated_nll"]) == pytest.approx((natural, gated), rel=1e-5)
    assert h["delta_nll"] == pytest.approx(gated - natural, abs=1e-5)
    rows = {r["variant"]: r["nll"] for r in report["update_variants"]}
    assert (rows["unpatched"], rows["projected"]) == pytest.approx(
        (natural, nll_with_ffn_rule(model, windows, projected)), rel=1e-5)


def test_calibration_keeps_model_weights_frozen_and_reloads_gates(calibrated, tiny_lm_folder):
    report, out = calibrated
    before = load_file(tiny_lm_folder / "model.safetensors")
    after = load_file(out / "model" / "model.safetensors")
    gate_keys = {k for k in after if k.endswith("tangent_patch.gate")}
    assert len(gate_keys) == 2 and set(after) - gate_keys == set(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    reloaded = ht.from_pretrained(out / "model")
    assert training.gate_values(reloaded) == {int(k): v for k, v in report["gates"].items()}
    assert (out / "gate_profile.png").stat().st_size > 1000 and (out / "loss_curve.png").is_file()
    card = (out / "model" / "README.md").read_text()
    assert "Delta L" in card and '"update": "add"' in card and "trust_remote_code=True" in card


def test_calibration_patch_repo_is_kilobytes_and_equals_the_full_folder(calibrated, tiny_lm_folder):
    """The default artifact of calibrate: a patch repo that records the base, under 100 kB, whose
    reload gives the logits of the complete folder saved by the same run."""
    _, out = calibrated
    files = {p.name: p.stat().st_size for p in (out / "patch").iterdir()}
    assert set(files) == {"README.md", "adapter_config.json", "adapter_model.safetensors"} and sum(files.values()) < 100_000
    record = json.loads((out / "patch" / "adapter_config.json").read_text())  # a PEFT adapter folder (format 3)
    assert (record["peft_type"], record["patch"]["update"], record["patch"]["gates"]) == ("HF_TANGENT", "add", True)
    assert record["base"]["name_or_path"] == str(tiny_lm_folder) and record["lora"] is None
    assert sorted(load_file(out / "patch" / "adapter_model.safetensors")) == [
        f"base_model.model.model.layers.{i}.tangent_patch.peft.hf_tangent_gate" for i in range(2)]
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(ht.from_pretrained(out / "patch").eval()(ids).logits,
                           ht.from_pretrained(out / "model").eval()(ids).logits)
    assert "Delta L" in (out / "patch" / "README.md").read_text()


def test_remote_code_loads_without_hf_tangent_in_a_fresh_process(calibrated, tmp_path):
    from conftest import logits_without_hf_tangent

    _, out = calibrated
    ids = torch.randint(0, 1000, (2, 16))
    with torch.no_grad():
        expected = ht.from_pretrained(out / "model").eval()(ids).logits
    assert torch.equal(logits_without_hf_tangent(out / "model", ids, tmp_path), expected)


def test_resume_from_checkpoint_equals_uninterrupted_run(tiny_lm_folder, austen_dir, tmp_path):
    full = calibrate(tiny_lm_folder, tmp_path / "full", austen_dir, save_steps=3, per_device_train_batch_size=2)
    # an interrupted run: its last checkpoint is at step 3 (what a kill after step 5 leaves behind)
    calibrate(tiny_lm_folder, tmp_path / "cut", austen_dir, save_steps=3, per_device_train_batch_size=2)
    shutil.rmtree(tmp_path / "cut" / "checkpoint-6")
    (tmp_path / "cut" / "checkpoint-9").mkdir()  # and a kill while the next one was being written: empty
    with pytest.warns(UserWarning, match=r"skipping incomplete checkpoints \['checkpoint-9'\]"):
        resumed = calibrate(tiny_lm_folder, tmp_path / "cut", austen_dir, save_steps=3, per_device_train_batch_size=2,
                            resume_from_checkpoint="last")
    assert resumed["gates"] == full["gates"]
    # the checkpoint carries the log history: the resumed run reports the whole curve, equal to the full run's
    assert resumed["loss_curve"] == full["loss_curve"] and len(full["loss_curve"]) == 6
    # a checkpoint holds what trains (the gates) and the Trainer's state, not the frozen base model
    checkpoint = tmp_path / "full" / "checkpoint-6"
    assert sorted(load_file(checkpoint / "trainable.safetensors")) == [
        f"model.layers.{i}.tangent_patch.gate" for i in range(2)]
    assert not list(checkpoint.glob("model*.safetensors")) and (checkpoint / "optimizer.pt").is_file()
    assert (checkpoint / "scheduler.pt").is_file() and (checkpoint / "trainer_state.json").is_file()
    weights = sum(f.stat().st_size for f in (tiny_lm_folder).glob("*.safetensors"))
    assert sum(f.stat().st_size for f in checkpoint.iterdir()) < weights / 10


def _lora_run(tiny_lm_folder, out, steps, **fields):
    """A LoRA run on the patched tiny model whose gates train too (outside the adapters): the
    trained state (adapters, gates) and the loss curve."""
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(tiny_lm_folder)
    ht.patch(model, ht.TangentConfig(update="projected", gates=True))
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"], lora_dropout=0.0))
    for name, param in model.named_parameters():
        if name.endswith(training.GATE_SUFFIX):
            param.requires_grad_(True)
    windows = torch.randint(0, 1000, (16, 16), generator=torch.Generator().manual_seed(0))
    args = ht.TangentTrainingArguments(output_dir=str(out), max_steps=steps, learning_rate=0.05, save_steps=2,
                                       per_device_train_batch_size=2, use_cpu=True, **fields)
    trainer = training.train(model, training.lm_dataset(windows), args)
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}, training.loss_curve(trainer)


def test_lora_checkpoints_hold_adapters_and_gates_and_resume_exactly(tiny_lm_folder, tmp_path):
    full, full_curve = _lora_run(tiny_lm_folder, tmp_path / "full", 4)
    checkpoint = tmp_path / "full" / "checkpoint-2"
    # PEFT's own adapter folder, plus the gates it does not hold; no base weights
    assert (checkpoint / "adapter_model.safetensors").is_file() and not list(checkpoint.glob("model*.safetensors"))
    assert sorted(load_file(checkpoint / "trainable.safetensors")) == [
        f"base_model.model.model.layers.{i}.tangent_patch.gate" for i in range(2)]
    shutil.rmtree(tmp_path / "full" / "checkpoint-4")
    resumed, resumed_curve = _lora_run(tiny_lm_folder, tmp_path / "full", 4, resume_from_checkpoint="last")
    assert resumed_curve == full_curve
    assert resumed.keys() == full.keys() and all(torch.equal(resumed[n], full[n]) for n in full)
    # a checkpoint of another run is refused, not half loaded
    with pytest.raises(ValueError, match="does not fit this model"):
        training.load_trainable(AutoModelForCausalLM.from_pretrained(tiny_lm_folder), str(checkpoint / "trainable.safetensors"))


def test_two_process_run_matches_single_process_same_global_batch(tiny_lm_folder, austen_dir, tmp_path):
    from test_sharded import free_port

    common = ["calibrate", "--model", str(tiny_lm_folder), "--text-files", str(austen_dir / "emma.txt"),
              "--calibration-files", str(austen_dir / "prideprejudice.txt"), "--seq-len", "32",
              "--max-windows", "2", "--train-windows", "8", "--max-steps", "4", "--learning-rate", "0.02",
              "--use-cpu"]
    single = subprocess.run([sys.executable, "-m", "hf_tangent.cli", *common, "--per-device-train-batch-size", "4",
                             "--output-dir", str(tmp_path / "one")], capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    double = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                             "--master_port", str(free_port()), "-m", "hf_tangent.cli", *common,
                             "--per-device-train-batch-size", "2",
                             "--output-dir", str(tmp_path / "two")],
                            capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert double.returncode == 0, double.stderr[-3000:]
    one = json.loads((tmp_path / "one" / "report.json").read_text())
    two = json.loads((tmp_path / "two" / "report.json").read_text())
    assert two["training"]["world_size"] == 2 and one["training"]["world_size"] == 1
    for layer, gate in one["gates"].items():
        assert two["gates"][layer] == pytest.approx(gate, abs=1e-5)
    assert all(abs(g - 1) > 1e-3 for g in two["gates"].values())
    # rank 0 wrote the patch repo of the 2-process run: it reloads with the reported gates
    reloaded = training.gate_values(ht.from_pretrained(tmp_path / "two" / "patch"))
    assert {str(k): v for k, v in reloaded.items()} == pytest.approx(two["gates"], abs=1e-7)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--recipe", "RECIPE"], "key 'max_step' is not an option of `calibrate`"),
        (["--dataset", "no-such/dataset-xyz"], "the dataset 'no-such/dataset-xyz' (a hub dataset) needs the Hugging Face Hub"),
        (["--seq-len", "60", "--calibration-files", "SHORT"], "fewer than one window of seq_len=60"),
        (["--calibration-files", "EMPTY"], "hold no text"),
        (["--layers", "5"], "layer index 5 is out of range for a model with 2 layers"),
        (["--update", "tangent"], "TangentConfig.update='tangent' is not one of the choices"),
    ],
)
def test_bad_input_fails_before_training(tiny_lm_folder, austen_dir, tmp_path, capsys, extra, message):
    (tmp_path / "r.yaml").write_text("max_step: 3\n")
    (tmp_path / "short.txt").write_text("Too short for one window.")
    (tmp_path / "empty.txt").write_text("\n\n")
    subs = {"RECIPE": str(tmp_path / "r.yaml"), "SHORT": str(tmp_path / "short.txt"), "EMPTY": str(tmp_path / "empty.txt")}
    extra = [subs.get(a, a) for a in extra]
    args = ["calibrate", "--model", str(tiny_lm_folder), "--seq-len", "32", "--output-dir", str(tmp_path / "o")]
    if "--dataset" not in extra:
        args += ["--text-files", str(austen_dir / "emma.txt")]
        if "--calibration-files" not in extra:
            args += ["--calibration-files", str(austen_dir / "prideprejudice.txt")]
    try:
        code = cli.main([*args, *extra])
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.strip().splitlines()[-1].startswith("hf-tangent calibrate: error: ")
    assert not list((tmp_path / "o").glob("checkpoint-*"))


def test_every_shipped_recipe_parses_and_the_command_line_wins():
    from importlib import resources

    recipes = sorted(Path(str(p)) for p in resources.files("hf_tangent.recipes").iterdir() if p.name.endswith(".yaml"))
    assert {p.stem for p in recipes} >= {"calibrate", "finetune_full", "finetune_lora", "offline_default"}
    for path in recipes:
        import yaml

        command = yaml.safe_load(path.read_text())["command"]
        args = cli.parse_args([command, "--recipe", str(path)])
        assert args.command == command and args.output_dir.startswith("runs/")
    args = cli.parse_args(["calibrate", "--recipe", "offline_default", "--max-steps", "3"])
    assert args.max_steps == 3 and args.seq_len == 256 and len(args.compare_updates) == 9


def run_finetune(folder, austen_dir, out, *, seeds, method="lora", rules=("projected",), save_models=False, lr=0.01,
                 steps=3, numpy=False):
    """`numpy`: every integer (and the exactly representable numbers) given as numpy scalars, as a script that
    reads them from an array would (issue 47: LoRA r=np.int64 reached PEFT's save, which failed)."""
    import numpy as np

    from hf_tangent.experiments.finetune import FinetuneTrainingArguments, LoraSettings

    as_given = (lambda v, kind=np.int64: kind(v)) if numpy else (lambda v, kind=None: v)
    text = ht.TextSource(text_files=(str(austen_dir / "emma.txt"),),
                         calibration_files=(str(austen_dir / "prideprejudice.txt"),))
    args = FinetuneTrainingArguments(output_dir=str(out), max_steps=as_given(steps), learning_rate=lr, use_cpu=True,
                                     per_device_train_batch_size=as_given(4), per_device_eval_batch_size=4,
                                     max_grad_norm=as_given(1.0, np.float32), weight_decay=as_given(0.0, np.float32))
    report = ht.finetune(str(folder), text=text, rules=list(rules), seeds=[as_given(s) for s in seeds], method=method,
                         lora=LoraSettings(r=as_given(8), alpha=as_given(16), targets=("q_proj", "down_proj")),
                         seq_len=as_given(32), max_windows=2, train_windows=as_given(8), training_args=args,
                         save_models=save_models)
    report.save(out)
    return json.loads((out / "report.json").read_text())


def test_finetune_runs_every_variant_with_paired_statistics(tiny_lm_folder, austen_dir, tmp_path):
    out = tmp_path / "ft"
    report = run_finetune(tiny_lm_folder, austen_dir, out, seeds=[0, 1], save_models=True, numpy=True)
    runs = {(r["variant"], r["seed"]): r for r in report["runs"]}
    assert all(type(r["seed"]) is int for r in report["runs"])
    adapter = json.loads((out / "runs" / "projected-seed0" / "patch" / "adapter" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (8, 16)  # PEFT's save of numpy r / alpha failed
    assert set(runs) == {("unpatched", 0), ("unpatched", 1), ("projected", 0), ("projected", 1)}
    assert all(len(r["loss_curve"]) == 3 for r in runs.values())
    summary = {s["variant"]: s for s in report["summary"]}
    # the patched runs' models are saved (save_models): their NLL recomputed from the saved weights, with
    # the projection written as plain torch hooks on the unpatched model
    from conftest import nll_with_ffn_rule, projected

    windows = pack_windows(load_tokenizer(str(tiny_lm_folder)), [(austen_dir / "emma.txt").read_text()], 32, 2)
    for seed in (0, 1):
        saved = ht.unpatch(ht.from_pretrained(out / "runs" / f"projected-seed{seed}" / "patch", merge=True)).eval()
        assert runs[("projected", seed)]["nll"] == pytest.approx(nll_with_ffn_rule(saved, windows, projected), rel=1e-5)
    deltas = [runs[("projected", s)]["nll"] - runs[("unpatched", s)]["nll"] for s in (0, 1)]
    assert summary["projected"]["delta_nll_mean"] == pytest.approx(sum(deltas) / 2)
    assert summary["projected"]["p_value"] == (0.5 if deltas[0] * deltas[1] > 0 else 1.0)  # exact sign flips, 2 seeds
    assert (out / "loss_curves.png").is_file() and "paired permutation" in (out / "report.md").read_text()
    # same seed, same data order: a rerun of one configuration reproduces it exactly (given plain numbers, the
    # numpy-given run's own)
    again = run_finetune(tiny_lm_folder, austen_dir, tmp_path / "again", seeds=[1])
    rerun = {(r["variant"], r["seed"]): r for r in again["runs"]}
    assert rerun[("projected", 1)]["nll"] == runs[("projected", 1)]["nll"]


def test_paired_permutation_test_against_enumeration():
    from hf_tangent.analysis.stats import paired_permutation_test

    assert paired_permutation_test([1.0, 2.0, 3.0]) == 2 / 8  # only all-plus and all-minus reach 2.0
    assert paired_permutation_test([1.0, -1.0]) == 1.0
    assert paired_permutation_test([0.5, 0.4, 0.6, 0.5, 0.45]) == 2 / 32


def test_evaluate_metric_loads_offline_and_matches_perplexity(tiny_lm_folder, austen_dir):
    import evaluate

    model = AutoModelForCausalLM.from_pretrained(tiny_lm_folder).eval()
    text = (austen_dir / "emma.txt").read_text()[:5000]
    windows = pack_windows(load_tokenizer(str(tiny_lm_folder)), [text], 16, 5)
    result = perplexity(model, windows)
    metric = evaluate.load(PERPLEXITY_METRIC)
    per_window = [nll * 15 for nll in result["window_nll"]]
    out = metric.compute(predictions=per_window, references=[15] * 5)
    assert out["perplexity"] == pytest.approx(result["perplexity"], rel=1e-9)
    assert out["tokens"] == result["tokens"] == 75


def test_strided_perplexity_scores_each_token_once_with_its_context(tiny_lm_folder):
    model = AutoModelForCausalLM.from_pretrained(tiny_lm_folder).eval()
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (23,))
    seq_len = 8
    with torch.no_grad():  # brute force: token t with up to seq_len - 1 tokens of context
        nlls = []
        for t in range(1, len(ids)):
            context = ids[max(0, t - (seq_len - 1)) : t]
            logits = model(context[None]).logits[0, -1]
            nlls.append(torch.nn.functional.cross_entropy(logits[None], ids[t : t + 1]).item())
    result = strided_perplexity(model, ids, seq_len, stride=1)
    assert result["tokens"] == len(ids) - 1
    assert result["nll"] == pytest.approx(sum(nlls) / len(nlls), rel=1e-5)
    coarse = strided_perplexity(model, ids, seq_len, stride=seq_len)
    assert coarse["tokens"] == len(ids) - math.ceil(len(ids) / seq_len)  # each window's first token has no context
    with pytest.raises(ValueError, match="stride=9 must be in 1..seq_len=8"):
        strided_perplexity(model, ids, seq_len, stride=9)


def test_push_to_hub_uploads_a_complete_repository(calibrated, monkeypatch, tiny_lm_folder):
    import huggingface_hub

    calls = {}

    def fake_create_repo(self, repo_id, **kwargs):
        calls["create"] = (repo_id, kwargs)

    def fake_upload_folder(self, repo_id, folder_path, **kwargs):
        calls["files"] = sorted(os.listdir(folder_path))
        calls["config"] = json.loads(open(os.path.join(folder_path, "config.json")).read())
        return "commit"

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", fake_create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", fake_upload_folder)
    _, out = calibrated
    model = ht.from_pretrained(out / "model")
    assert ht.push_to_hub(model, "user/tiny-gated", private=True) == "commit"
    assert calls["create"] == ("user/tiny-gated", {"private": True, "exist_ok": True})
    assert {"config.json", "model.safetensors", "README.md", "modeling_hf_tangent.py", "configuration_hf_tangent.py",
            "install.py"} <= set(calls["files"])
    assert calls["config"]["auto_map"] == {"AutoConfig": "configuration_hf_tangent.HfTangentLlamaConfig",
                                           "AutoModelForCausalLM": "modeling_hf_tangent.HfTangentLlamaForCausalLM"}
    assert calls["config"]["model_type"] == "hf_tangent_llama"
    assert calls["config"]["hf_tangent"]["config"]["gates"] is True
    with pytest.raises(ValueError, match="expects a model patched"):
        ht.push_to_hub(AutoModelForCausalLM.from_pretrained(tiny_lm_folder), "user/x")


def test_remote_code_ships_every_module_it_imports():
    import re

    from hf_tangent.artifacts import hub

    shipped = set(hub.SHIPPED_CORE_MODULES)
    shipped |= {hub.REMOTE_CONFIG_FILE}  # generated next to the modeling file
    core = Path(hub.__file__).resolve().parents[1] / "core"
    texts = [(core / name).read_text() for name in hub.SHIPPED_CORE_MODULES] + [hub._MODELING_TEMPLATE,
                                                                               hub._CONFIG_TEMPLATE, hub.core_imports()]
    for text in texts:
        for module in re.findall(r"^\s*from \.(\w+) import", text, flags=re.M):
            assert f"{module}.py" in shipped, module
        assert not re.search(r"^\s*from \. import|^\s*from hf_tangent", text, flags=re.M)
        # hf_tangent itself only where remote.py uses an installed one of the same or a newer release, inside a
        # try block (transformers' own check of a remote module's imports skips those)
        imports = re.findall(r"^( *)import hf_tangent.*$", text, flags=re.M)
        assert imports == [] or (text == (core / "remote.py").read_text() and imports == [" " * 8]), imports


def test_calibration_options_checkpointing_accumulation_bf16(tiny_lm_folder, austen_dir, tmp_path):
    report = calibrate(tiny_lm_folder, tmp_path / "opts", austen_dir, gradient_checkpointing=True,
                       gradient_accumulation_steps=2, bf16=True, per_device_train_batch_size=4, max_steps=2,
                       save_model=False)
    assert report["training"]["gradient_checkpointing"] and report["training"]["bf16"]
    assert report["training"]["grad_accum"] == 2 and len(report["loss_curve"]) == 2
    assert all(abs(g - 1.0) > 1e-4 for g in report["gates"].values())


def test_full_finetune_changes_weights_and_keeps_the_patch(tiny_lm_folder, austen_dir, tmp_path):
    out = tmp_path / "full"
    run_finetune(tiny_lm_folder, austen_dir, out, seeds=[0], method="full", rules=["retract p=2 (cayley)"],
                 save_models=True, lr=1e-3, steps=2)
    saved = out / "runs" / "retract_p=2-seed0" / "model"
    model = ht.from_pretrained(saved)
    assert ht.get_config(model).update == "retract" and ht.get_config(model).p == 2.0
    before = load_file(tiny_lm_folder / "model.safetensors")
    after = load_file(saved / "model.safetensors")
    assert not torch.equal(after["model.layers.0.mlp.up_proj.weight"], before["model.layers.0.mlp.up_proj.weight"])
