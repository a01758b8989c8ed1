"""Healing (heal.py): the homotopy, the teacher, the distillation loss, and Trainer runs on tiny models."""

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import logits_without_hf_tangent, make_tiny, nll_with_ffn_rule

import hf_tangent as ht
from hf_tangent.ranges import ChoiceError, OptionTypeError, RangeError
from hf_tangent.training.healing import (
    HomotopyCallback,
    distillation_loss,
    heal_trainer_class,
    held_out_kl,
    homotopy_value,
    teacher_of,
)
from hf_tangent.training.trainer import lm_dataset, train, training_arguments


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def layer_io(model, index, ids):
    """(x = the pre-FFN norm's input, y = the MLP output, out = the layer output) of one Llama layer, float64."""
    layer, seen = model.model.layers[index], {}
    handles = [layer.post_attention_layernorm.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0].double())),
               layer.mlp.register_forward_hook(lambda m, a, o: seen.__setitem__("y", o.double())),
               layer.register_forward_hook(lambda m, a, o: seen.__setitem__("out", (o[0] if isinstance(o, tuple) else o).double()))]
    logits(model, ids)
    for h in handles:
        h.remove()
    return seen


def test_homotopy_endpoints_are_bit_identical_and_the_middle_is_the_blend(ids):
    model = make_tiny("llama")
    reference = logits(model, ids)
    ht.patch(model, ht.TangentConfig(update="projected", layers=[1]))
    target = logits(model, ids)
    ht.set_homotopy(model, 0.0)
    assert torch.equal(logits(model, ids), reference)
    ht.set_homotopy(model, 1.0)
    assert torch.equal(logits(model, ids), target)
    ht.set_homotopy(model, 0.25)
    seen = layer_io(model, 1, ids)  # layer 0 is unpatched, so layer 1 sees the unpatched input
    x, y = seen["x"], layer_io(ht.unpatch(make_tiny("llama")), 1, ids)["y"]
    eps = ht.get_config(model).eps
    projected = y - (x * y).sum(-1, keepdim=True) / ((x * x).sum(-1, keepdim=True) + eps) * x
    torch.testing.assert_close(seen["out"], x + 0.75 * y + 0.25 * projected, rtol=1e-5, atol=1e-5)
    assert ht.get_homotopy(model) == 0.25 and model.config.hf_tangent["homotopy"]["lambda"] == 0.25
    with pytest.raises(RangeError, match=r"lambda=1.5 is out of range; accepted: a number >= 0 and <= 1 or a mapping\."):
        ht.set_homotopy(model, 1.5)
    with pytest.raises(ValueError, match="not patched"):
        ht.set_homotopy(make_tiny("llama"), 0.5)


def test_parallel_conversion_homotopy_endpoints(ids):
    model = make_tiny("llama")
    reference = logits(model, ids)
    ht.patch(model, ht.TangentConfig(parallel_layers=[0, 1]))
    target = logits(model, ids)
    assert not torch.equal(target, reference)
    ht.set_homotopy(model, 0.0)
    assert torch.equal(logits(model, ids), reference)
    ht.set_homotopy(model, 1.0)
    assert torch.equal(logits(model, ids), target)


def test_homotopy_schedules():
    assert [homotopy_value(s, 4) for s in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert homotopy_value(2, 4, "cosine") == pytest.approx(0.5) and homotopy_value(1, 4, "cosine") < 0.25
    assert homotopy_value(0, 0) == 1.0  # no homotopy: the target from step 0
    with pytest.raises(ChoiceError, match=r"schedule='cubic' is not one of the choices; accepted: one of 'linear', 'cosine'\."):
        HomotopyCallback(4, "cubic")  # the words of every option (core/options.py; was its own check)
    with pytest.raises(OptionTypeError, match=r"stages=2\.0 has the wrong type \(float\); accepted: an integer >= 1\."):
        HomotopyCallback(4, stages=2.0)
    assert type(HomotopyCallback(np.int64(4)).steps) is int


def test_progressive_homotopy_moves_one_layer_group_at_a_time():
    callback = HomotopyCallback(6, stages=3)
    for step in range(8):
        expected = {i: min(max((step - 2 * g) / 2, 0.0), 1.0) for g, i in enumerate((0, 1, 2))}  # 2 steps per group
        assert callback.lambdas(step, [0, 1, 2]) == expected
    # 5 layers in 2 groups: depth order, the first round(5/2) = 2 layers first
    assert HomotopyCallback(4, stages=2).lambdas(1, [3, 4, 5, 6, 7]) == {3: 0.5, 4: 0.5, 5: 0.0, 6: 0.0, 7: 0.0}
    with pytest.raises(ValueError, match="stages=4 > the 3 patched layers; accepted: at most 3"):
        HomotopyCallback(6, stages=4).lambdas(0, [0, 1, 2])
    with pytest.raises(RangeError, match=r"stages=0 is out of range; accepted: an integer >= 1\."):
        HomotopyCallback(6, stages=0)


def test_per_layer_lambda_equals_patching_only_the_layers_at_one(ids):
    # lambda 0 on a layer is bit-identical to leaving it unpatched, so {0: 0, 1: 1, 2: 0} on an
    # all-layer patch must give exactly the logits of a patch of layer 1 alone.
    config = ht.TangentConfig(update="norm_preserving")
    staged = ht.set_homotopy(ht.patch(make_tiny("llama"), config), {0: 0.0, 1: 1.0, 2: 0.0})
    alone = ht.patch(make_tiny("llama"), ht.TangentConfig(update="norm_preserving", layers=[1]))
    assert torch.equal(logits(staged, ids), logits(alone, ids))
    assert ht.get_homotopy(staged) == {0: 0.0, 1: 1.0, 2: 0.0}
    assert staged.config.hf_tangent["homotopy"]["lambda"] == {"0": 0.0, "1": 1.0, "2": 0.0}
    with pytest.raises(ValueError, match=r"the mapping gives layers \[0, 1\]; accepted: exactly the patched layers \[0, 1, 2\]"):
        ht.set_homotopy(staged, {0: 0.5, 1: 0.5})
    with pytest.raises(ValueError, match="entry 'x': 0.5; accepted: layer index -> number in"):
        ht.set_homotopy(staged, {"x": 0.5, 1: 0.5, 2: 0.5})
    # a layer given twice ("0" and 0: the last one was kept) and a digit that is not JSON's ("٠" was layer 0; "²"
    # raised int()'s own error)
    for mapping in ({"0": 0.5, 0: 0.2, 1: 0.5, 2: 0.5}, {"\u0660": 0.5, 1: 0.5, 2: 0.5}, {"\u00b2": 0.5, 0: 0.5, 1: 0.5}):
        with pytest.raises(ValueError, match=r"; accepted: layer index -> number in \[0, 1\], each layer once\."):
            ht.set_homotopy(staged, mapping)
    assert ht.get_homotopy(staged) == {0: 0.0, 1: 1.0, 2: 0.0}  # a refused call changes nothing
    # numpy's integers are layer indices (np.int64 keys were refused), kept as int in the record
    ht.set_homotopy(staged, {np.int64(0): 0.0, np.int32(1): 1.0, 2: 0.0})
    assert staged.config.hf_tangent["homotopy"]["lambda"] == {"0": 0.0, "1": 1.0, "2": 0.0}
    assert torch.equal(logits(staged, ids), logits(alone, ids))


def test_resume_mid_progressive_homotopy(tmp_path):
    model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected"))
    _, full = _heal(model, tmp_path / "a", 4, homotopy_steps=4, save_steps=2, stages=2)
    resumed_model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected"))
    _, resumed = _heal(resumed_model, tmp_path / "a", 4, homotopy_steps=4, stages=2,
                       resume=str(tmp_path / "a" / "checkpoint-2"))
    # 3 layers in 2 groups: [0, 1] then [2], 2 steps each
    assert resumed.values[0] == (2, {0: 1.0, 1: 1.0, 2: 0.0}) == next(v for v in full.values if v[0] == 2)
    assert (3, {0: 1.0, 1: 1.0, 2: 0.5}) in resumed.values
    assert ht.get_homotopy(resumed_model) == 1.0


def test_distillation_loss_against_an_independent_kl():
    torch.manual_seed(0)
    s, t = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    p, q = torch.softmax(t.double() / 2, -1), torch.softmax(s.double() / 2, -1)
    expected = (p * (p.log() - q.log())).sum(-1).mean() * 4
    assert distillation_loss(s, t, 2.0).item() == pytest.approx(expected.item(), rel=1e-5)
    assert distillation_loss(t, t).item() == pytest.approx(0.0, abs=1e-7)


def test_teacher_is_the_unpatched_model_without_adapters_and_is_restored(ids):
    from peft import LoraConfig, get_peft_model

    model = make_tiny("llama")
    reference = logits(model, ids)
    peft = get_peft_model(ht.patch(model, ht.TangentConfig(update="projected")),
                          LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    student = logits(peft, ids)
    with teacher_of(peft) as teacher:
        assert torch.equal(teacher(ids).logits, reference)
    assert torch.equal(logits(peft, ids), student)
    with pytest.raises(RuntimeError, match="boom"), teacher_of(peft):
        raise RuntimeError("boom")
    assert torch.equal(logits(peft, ids), student)
    wrapped = torch.nn.DataParallel(peft)  # as a Trainer may hand the model to compute_loss
    with teacher_of(wrapped) as teacher:  # the adapters inside the wrapper are switched off too
        assert torch.equal(teacher(ids).logits, reference)
    assert torch.equal(logits(wrapped, ids), student)


def _heal(model, tmp_path, steps, *, homotopy_steps, resume=None, save_steps=0, seed=0, lr=3e-3, n=16, batch=4,
          stages=1):
    torch.manual_seed(seed)
    data = lm_dataset(torch.randint(0, 128, (n, 16)))
    args = training_arguments(str(tmp_path), max_steps=steps, learning_rate=lr, batch_size=batch, save_steps=save_steps,
                              seed=seed, resume_from_checkpoint=resume)
    callback = HomotopyCallback(homotopy_steps, stages=stages)
    trainer = train(model, data, args, callbacks=[callback], trainer_class=heal_trainer_class())
    return trainer, callback


def test_tiny_heal_lowers_the_held_out_kl(tmp_path):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    held_out = torch.randint(0, 128, (4, 16))
    model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected", alpha=3.0))  # KL ~0.12 untrained
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]))
    before = held_out_kl(model, held_out)
    assert before == pytest.approx(_independent_kl(model, held_out), rel=1e-5)
    _heal(model, tmp_path, 60, homotopy_steps=10, lr=1e-2, n=480, batch=8)  # 60 steps, each batch new
    after = held_out_kl(model, held_out)
    assert ht.get_homotopy(model) == 1.0
    assert after == pytest.approx(_independent_kl(model, held_out), rel=1e-5)
    assert after < before, (before, after)


def _independent_kl(peft_model, ids):
    """Mean KL(teacher || student) per token; the teacher is the base model with the patch removed
    and the adapters off, taken apart by hand (a copy: unpatch + unload)."""
    import copy

    student = copy.deepcopy(peft_model).eval()
    teacher = ht.unpatch(copy.deepcopy(peft_model).unload()).eval()
    with torch.no_grad():
        p = torch.log_softmax(teacher(ids).logits.double(), -1)
        q = torch.log_softmax(student(ids).logits.double(), -1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


def test_resume_mid_homotopy_continues_the_schedule(tmp_path):
    model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected"))
    trainer, full = _heal(model, tmp_path / "a", 4, homotopy_steps=4, save_steps=2)
    assert [v for _, v in full.values][:5] == [0.0, 0.0, 0.25, 0.5, 0.75]
    resumed_model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected"))
    _, resumed = _heal(resumed_model, tmp_path / "a", 4, homotopy_steps=4, resume=str(tmp_path / "a" / "checkpoint-2"))
    assert resumed.values[0] == (2, 0.5) and resumed.values[-1] == (4, 1.0)
    assert full.values[-1] == (4, 1.0)


@pytest.mark.parametrize("value", [0.4, {0: 0.2, 1: 0.9, 2: 0.4}], ids=["uniform", "per_layer"])
def test_homotopy_round_trips_through_save_and_reload(tmp_path, ids, value):
    model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="retract", p=2.0, gates=True))
    ht.set_homotopy(model, value, schedule="cosine", steps=10)
    saved = value if not isinstance(value, dict) else {str(k): v for k, v in value.items()}
    expected = logits(model, ids)
    ht.save_pretrained(model, tmp_path / "m")
    torch.save((ids, expected), tmp_path / "io.pt")
    script = textwrap.dedent(f"""
        import torch, hf_tangent as ht
        ids, expected = torch.load({str(tmp_path / 'io.pt')!r})
        model = ht.from_pretrained({str(tmp_path / 'm')!r}).eval()
        assert ht.get_homotopy(model) == {value!r}
        assert model.config.hf_tangent["homotopy"] == {{"lambda": {saved!r}, "schedule": "cosine", "steps": 10}}
        with torch.no_grad():
            assert torch.equal(model(ids).logits, expected)
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


def test_heal_command_report_and_healed_hub_folder(tiny_lm_folder, austen_dir, tmp_path, capsys):
    import json

    from transformers import LlamaForCausalLM

    from hf_tangent import cli

    out = tmp_path / "heal"
    code = cli.main(["heal", "--model", str(tiny_lm_folder), "--text-files", str(austen_dir / "emma.txt"),
                     "--calibration-files", str(austen_dir / "northangerabbey.txt"),
                     "--seq-len", "32", "--max-windows", "4", "--train-windows", "16", "--max-steps", "6",
                     "--per-device-train-batch-size", "4", "--update", "retract p=2 (cayley)", "--layers", "0", "1",
                     "--homotopy-fraction", "0.5", "--stages", "2", "--save-models", "true", "--save-full-models", "true",
                     "--output-dir", str(out)])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    run = report["runs"][0]
    assert report["command"] == "heal" and run["homotopy"] == 1.0 and len(run["loss_curve"]) == 6
    # independent: the healed folder reloads as a patched model whose held-out NLL is the reported one
    healed = ht.from_pretrained(run["saved"]["model"]).eval()
    assert ht.get_config(healed).update == "retract" and ht.get_homotopy(healed) == 1.0
    from hf_tangent.artifacts.models import load_tokenizer
    from hf_tangent.training.data import pack_windows

    text = open(austen_dir / "emma.txt", encoding="utf-8").read()
    documents = [text]
    held_out = pack_windows(load_tokenizer(str(tiny_lm_folder)), documents, 32, 4)
    assert held_out.shape[0] == report["eval_windows"]
    unpatched = nll_with_ffn_rule(LlamaForCausalLM.from_pretrained(tiny_lm_folder).eval(), held_out)
    assert report["unpatched_nll"] == pytest.approx(unpatched, rel=1e-5)
    # the healed NLL: the saved (LoRA-merged) weights, the retraction written out in float64 as plain hooks
    from test_patching import expected_delta

    rule = ht.get_config(healed)
    weights = ht.unpatch(ht.from_pretrained(run["saved"]["model"])).eval()
    healed_nll = nll_with_ffn_rule(weights, held_out, lambda x, y, i: expected_delta(rule, x, y))
    assert run["healed"]["nll"] == pytest.approx(healed_nll, rel=1e-4)
    card = (out / "runs" / "seed0" / "model" / "README.md").read_text()
    assert "healed" in card and f"{run['healed']['nll']:.4f}" in card
    assert "| mean |" in (out / "report.md").read_text()
    assert "progressive in 2 layer groups" in (out / "report.md").read_text() and report["settings"]["stages"] == 2
    # the healed Hub folder: KV-cache generation equals uncached, and it loads without hf_tangent (remote code)
    ids = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = healed(ids).logits
        cached = healed.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
        uncached = healed.generate(ids, max_new_tokens=6, do_sample=False, use_cache=False, pad_token_id=0)
    assert torch.equal(cached, uncached)
    assert torch.equal(logits_without_hf_tangent(run["saved"]["model"], ids, tmp_path), expected)
    # the default artifact: the patch repo (patch + LoRA adapters, unmerged) gives the same model
    patch_repo = ht.from_pretrained(run["saved"]["patch"]).eval()
    assert (Path(run["saved"]["patch"]) / "adapter" / "adapter_model.safetensors").is_file()
    with torch.no_grad():
        torch.testing.assert_close(patch_repo(ids).logits, expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(SystemExit):
        cli.main(["heal", "--model", str(tiny_lm_folder), "--update", "nope"])


@pytest.mark.parametrize("recipe", ["heal_default", "heal_full", "heal_parallel", "heal_long"])
def test_heal_recipes_parse(recipe):
    from hf_tangent import cli

    args = cli.parse_args(["heal", "--recipe", recipe])
    model, text, calibration, options, *_, training = cli_dataclasses(args)
    steps = 120 if recipe == "heal_long" else 60
    assert options.update in ("projected", "add") and training.max_steps == steps and model.model == "smollm2-135m"
    if recipe == "heal_parallel":
        assert options.parallel_layers == [6, 7, 8, 9, 20, 21, 22, 23]


def cli_dataclasses(args):
    from hf_tangent.commands.arguments import dataclasses_of

    return dataclasses_of(args.parser, args)


def _first_step(tmp_path, *, batch, accumulation, lm_weight=0.0):
    """(logged loss, grad norm) of the first optimizer step of a heal run on fixed data."""
    model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected"))
    data = lm_dataset(torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(0)))
    args = training_arguments(str(tmp_path), max_steps=1, learning_rate=1e-3, batch_size=batch, grad_accum=accumulation,
                              seed=0, max_grad_norm=1e9)
    trainer = train(model, data, args, trainer_class=heal_trainer_class(), lm_weight=lm_weight)
    row = next(r for r in trainer.state.log_history if "loss" in r)
    return row["loss"], row["grad_norm"]


@pytest.mark.parametrize("lm_weight", [0.0, 0.5])
def test_gradient_accumulation_gives_the_loss_and_gradients_of_the_whole_batch(tmp_path, lm_weight):
    """Defect: compute_loss ignored num_items_in_batch, so the Trainer skipped its division by the
    accumulation steps (Llama accepts loss kwargs): accumulation 2 logged twice the loss."""
    loss_1, norm_1 = _first_step(tmp_path / "a", batch=4, accumulation=1, lm_weight=lm_weight)
    loss_2, norm_2 = _first_step(tmp_path / "b", batch=2, accumulation=2, lm_weight=lm_weight)
    assert loss_1 > 0 and loss_2 == pytest.approx(loss_1, rel=1e-4)
    assert norm_2 == pytest.approx(norm_1, rel=1e-4)


def test_the_teacher_runs_without_dropout_and_the_training_flags_come_back(ids):
    model = make_tiny("llama", attention_dropout=0.5)
    reference = logits(model, ids)  # eval mode: dropout off
    ht.patch(model, ht.TangentConfig(update="projected")).train()
    model.model.layers[0].eval()  # one module's own flag, which must come back as it was
    with teacher_of(model) as teacher:
        assert torch.equal(teacher(ids).logits, reference)
        assert torch.equal(teacher(ids).logits, reference)
    assert model.training and not model.model.layers[0].training and model.model.layers[1].training
    assert held_out_kl(model, ids) < 1e9 and model.training and not model.model.layers[0].training


def test_a_frozen_teacher_is_moved_to_the_training_device(tmp_path):
    """--method full: the teacher copy follows the student to args.device (on a GPU it stayed on the
    CPU). Without a GPU the move is observed on the copy; tests/test_gpu.py runs it on CUDA."""
    moves = []

    class Spy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = make_tiny("llama")

        def to(self, *args, **kwargs):
            moves.append(args[0] if args else kwargs.get("device"))
            return super().to(*args, **kwargs)

    teacher = Spy().train()
    model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected"))
    args = training_arguments(str(tmp_path), max_steps=1, learning_rate=1e-3, batch_size=2)
    trainer = heal_trainer_class()(model=model, args=args, train_dataset=lm_dataset(torch.zeros(4, 8, dtype=torch.long)),
                                   teacher=teacher)
    assert moves == [trainer.args.device] and not teacher.training
    assert not any(p.requires_grad for p in teacher.parameters())


def test_heal_reports_every_held_out_domain_against_an_independent_nll(tiny_lm_folder, tmp_path):
    """heal's default text is the mixed corpus (here built from the kept excerpts: conftest): the
    training windows are shared by its domains, and each held-out domain's NLL of the unpatched
    model, of the untrained patch and of the healed model, their paired differences and the pooled
    figure equal an independent computation on the same windows (plain torch hooks on the base and on
    the saved healed weights); every bootstrap interval holds its difference. With --corpus austen
    the training is the novels alone and the report still covers every held-out domain."""
    import json

    from test_patching import expected_delta
    from transformers import LlamaForCausalLM

    from hf_tangent import cli
    from hf_tangent.artifacts.models import load_tokenizer
    from hf_tangent.training import corpora
    from hf_tangent.training.data import pack_windows

    out = tmp_path / "heal"
    common = ["--model", str(tiny_lm_folder), "--seq-len", "32", "--max-windows", "3", "--max-steps", "2",
              "--per-device-train-batch-size", "4", "--update", "projected"]
    assert cli.main(["heal", *common, "--train-windows", "14", "--save-full-models", "true", "--output-dir", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    names = list(corpora.DOMAINS)
    assert report["corpus"] == "mixed" and list(report["domains"]) == names
    assert report["train_domains"] == {n: 3 if k < 2 else 2 for k, n in enumerate(names)}  # 14 windows, 6 domains
    tokenizer = load_tokenizer(str(tiny_lm_folder))
    base = LlamaForCausalLM.from_pretrained(tiny_lm_folder).eval()
    run = report["runs"][0]
    weights = ht.unpatch(ht.from_pretrained(run["saved"]["model"])).eval()
    rule = ht.TangentConfig(update="projected")

    def nlls(model, windows, patched):
        return [nll_with_ffn_rule(model, w[None], (lambda x, y, i: expected_delta(rule, x, y)) if patched else None)
                for w in windows]

    pooled = []
    for name in names:
        windows = pack_windows(tokenizer, corpora.domain_documents(name, "heldout"), 32, 3)
        entry, row = report["domains"][name], report["domains"][name]["runs"][0]
        assert entry["windows"] == len(windows) == 3
        unpatched = nlls(base, windows, False)
        pooled += unpatched
        assert entry["unpatched_nll"] == pytest.approx(sum(unpatched) / 3, rel=1e-5)
        for stage, model in (("untrained", base), ("healed", weights)):
            expected = sum(nlls(model, windows, True)) / 3 - sum(unpatched) / 3
            got = row[stage]
            assert got["delta_nll"] == pytest.approx(expected, abs=2e-4), (name, stage)
            assert got["low"] <= got["delta_nll"] <= got["high"]
        assert entry["healed_delta_nll"] == row["healed"]["delta_nll"]
    assert report["unpatched_nll"] == pytest.approx(sum(pooled) / len(pooled), rel=1e-5)
    markdown = (out / "report.md").read_text()
    assert all(f"| {name} | 3 |" in markdown for name in names) and "trained on austen 3, python 3" in markdown
    # --corpus austen: the novels train, every domain is still reported
    assert cli.main(["heal", *common, "--train-windows", "4", "--corpus", "austen", "--output-dir", str(tmp_path / "a")]) == 0
    austen = json.loads((tmp_path / "a" / "report.json").read_text())
    assert austen["corpus"] == "austen" and austen["train_domains"] == {"austen": 4}
    assert austen["text"] == {"evaluation": "mixed (" + ", ".join(names) + "):heldout", "calibration": "austen:calibration"}
    assert list(austen["domains"]) == names
    assert austen["domains"]["python"]["unpatched_nll"] == report["domains"]["python"]["unpatched_nll"]


def test_the_corpus_option_refuses_text_given_with_it(tiny_lm_folder, austen_dir, tmp_path, capsys):
    """--corpus mixed names the offline text used where none is given: with --text-files too, one
    error naming both, before any model loads; an unknown corpus is refused by the parser."""
    from hf_tangent import cli
    from hf_tangent.training.data import TextSource

    code = cli.main(["heal", "--model", str(tiny_lm_folder), "--text-files", str(austen_dir / "emma.txt"),
                     "--corpus", "mixed", "--output-dir", str(tmp_path / "o")])
    assert code == 2 and "corpus='mixed' is the offline text used where none is given, and text_files given too" \
        in capsys.readouterr().err
    with pytest.raises(ValueError, match="corpus='austen' is the offline text used where none is given"):
        TextSource(corpus="austen", text_files=(str(austen_dir / "emma.txt"),))
    with pytest.raises(SystemExit):
        cli.main(["heal", "--model", str(tiny_lm_folder), "--corpus", "wiki"])
    assert "invalid choice: 'wiki'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="corpus='mixed'.*calibration_documents given too"):
        TextSource(corpus="mixed", calibration_documents=("a",))
    with pytest.raises((ValueError, TypeError), match="corpus"):
        TextSource(corpus="wiki")
    assert not (tmp_path / "o").exists()
