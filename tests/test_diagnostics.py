"""Diagnostics against a direct, non-streamed float64 computation; ablations; callback; CLI."""

import json

import pytest
import torch
from conftest import layer_output, make_tiny, spec_of

import hf_tangent as ht
from hf_tangent import cli
from hf_tangent.analysis import ablation, diagnostics
from hf_tangent.analysis.evaluation import perplexity
from hf_tangent.training import trainer as training

EPS = 1e-6


def capture_all(model, ids):
    """Per layer: block input h and output (hidden states), x, raw y, added delta: full tensors."""
    spec = spec_of(model)
    rec, handles = {}, []
    for i, layer in enumerate(spec.decoder_layers(model)):
        handles += [
            spec.submodule(layer, "ffn_norm").register_forward_pre_hook(lambda m, a, i=i: rec.__setitem__(("x", i), a[0])),
            spec.submodule(layer, "ffn_out").register_forward_hook(
                lambda m, a, o, i=i: rec.__setitem__(("y", i), layer_output(o)), prepend=True),
            spec.submodule(layer, "ffn_out").register_forward_hook(lambda m, a, o, i=i: rec.__setitem__(("d", i), layer_output(o))),
            layer.register_forward_pre_hook(lambda m, a, kw, i=i: rec.__setitem__(("h", i), a[0] if a else kw["hidden_states"]),
                                            with_kwargs=True),
            layer.register_forward_hook(lambda m, a, o, i=i: rec.__setitem__(("out", i), layer_output(o))),
        ]
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    return {k: v.double() for k, v in rec.items()}


def direct_quantities(t, i):
    """math.md section 4, written out again, float64, from full tensors."""
    h, x, y, d, out = t[("h", i)], t[("x", i)], t[("y", i)], t[("d", i)], t[("out", i)]
    attn = out - d - h
    dot = lambda a, b: (a * b).sum(-1)  # noqa: E731
    n = lambda a: a.norm(dim=-1)  # noqa: E731
    u = h / n(h)[..., None]
    tan = lambda v: v - dot(u, v)[..., None] * u  # noqa: E731
    ta, tf = tan(attn), tan(d)
    tb = ta + tf
    unit = lambda a: a / n(a)[..., None]  # noqa: E731
    div = lambda p: 1 - unit(p).mean(-2).pow(2).sum(-1)  # noqa: E731
    return {
        "rho": dot(x, y).abs() / (n(x) * n(y) + EPS),
        "orthogonality_error": dot(x, d).abs() / (n(x) * n(d) + EPS),
        "norm_x": n(x),
        "norm_out": n(out),
        "ffn_angle": torch.arccos((dot(x, x + d) / (n(x) * n(x + d))).clamp(-1, 1)),
        "deficit": 1 - dot(ta, tb) / (n(ta) * n(tb)),
        "ffn_share": dot(tf, tb) / dot(tb, tb),
        "diversity_before_attention": div(h),
        "diversity_after_attention": div(h + attn),
        "diversity_after_ffn": div(out),
    }


@pytest.mark.parametrize("arch, update", [("gpt2", None), ("gpt_neox_parallel", None), ("llama", "projected"),
                                          ("gpt_neox_sequential", "retract"), ("mistral", None)])
def test_streamed_statistics_match_direct_computation(arch, update, ids):
    model = make_tiny(arch)
    if update:
        ht.patch(model, ht.TangentConfig(update=update, layers=[0, 2]))
    windows = torch.cat([ids, ids.flip(1), ids.roll(3, 1)])  # (6, 12), fed in 3 batches of 2
    records = diagnostics.diagnose(model, windows, batch_size=2)
    direct = capture_all(model, windows)
    for r in records:
        expected = direct_quantities(direct, r["layer"])
        for name in diagnostics.QUANTITIES:
            values = expected[name].reshape(-1)
            got = r[name]
            scale = max(1.0, values.abs().max().item())
            assert got["count"] == values.numel(), name
            assert got["mean"] == pytest.approx(values.mean().item(), rel=1e-5, abs=1e-5 * scale), name
            assert got["std"] == pytest.approx(values.std(unbiased=False).item(), rel=1e-4, abs=1e-5 * scale), name
            assert got["min"] == pytest.approx(values.min().item(), rel=1e-5, abs=1e-5 * scale), name
            assert got["max"] == pytest.approx(values.max().item(), rel=1e-5, abs=1e-5 * scale), name
            assert got["q05"] <= got["q50"] <= got["q95"]


def test_diagnostics_leave_outputs_bit_identical_and_remove_hooks(ids):
    for arch in ("gpt2", "gpt_neox_parallel", "llama"):
        model = ht.patch(make_tiny(arch), ht.TangentConfig(update="soft", beta=0.5))
        def hooks(model=model):
            return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())

        before = hooks()
        with torch.no_grad():
            reference = model(ids).logits
            with diagnostics.record(model) as rec:
                observed = model(ids).logits
        assert torch.equal(observed, reference)
        assert hooks() == before and rec.records()[0]["rho"]["count"] == ids.numel()
        with pytest.raises(RuntimeError, match="boom"), diagnostics.record(model):
            raise RuntimeError("boom")
        assert hooks() == before


def test_orthogonality_error_reads_zero_for_projected_and_rho_for_add(ids):
    add = diagnostics.diagnose(make_tiny("llama"), ids)
    projected = diagnostics.diagnose(ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected")), ids)
    for a, p in zip(add, projected, strict=True):
        assert a["orthogonality_error"]["mean"] == pytest.approx(a["rho"]["mean"])
        assert a["rho"]["mean"] > 1e-2
        assert p["orthogonality_error"]["max"] < 1e-5


def test_running_stat_streams_exactly_and_stays_bounded():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(10_000, generator=g, dtype=torch.float64) * 3 + 1
    stat = diagnostics.RunningStat(reservoir_size=500)
    for chunk in values.split(777):
        stat.update(chunk)
    s = stat.summary()
    assert s["count"] == 10_000 and stat.reservoir.numel() == 500
    assert s["mean"] == pytest.approx(values.mean().item(), rel=1e-12)
    assert s["std"] == pytest.approx(values.std(unbiased=False).item(), rel=1e-12)
    assert (s["min"], s["max"]) == (values.min().item(), values.max().item())
    assert s["q50"] == pytest.approx(values.median().item(), abs=0.4)  # a 500-sample estimate


def test_bad_input_errors(ids):
    model = make_tiny("gpt2")
    with pytest.raises(ValueError, match=r"layer indices \[3\] out of range; accepted: 0..2"):
        diagnostics.diagnose(model, ids, layers=[0, 3])
    with pytest.raises(ValueError, match="no windows"):
        diagnostics.diagnose(model, ids[:0])
    with pytest.raises(ValueError, match="unknown ablation 'half'"):
        with ablation.ablated(model, "half"):
            pass


def test_trainer_callback_logs_through_the_trainer(tmp_path, ids):
    model = make_tiny("llama")
    args = training.training_arguments(str(tmp_path), max_steps=2, learning_rate=1e-3, batch_size=2)
    from transformers import Trainer, default_data_collator

    trainer = Trainer(model=model, args=args, train_dataset=training.lm_dataset(ids), data_collator=default_data_collator)
    training.diagnostics_callback(ids, every_n_steps=1, quantities=("rho", "norm_x")).attach(trainer)
    trainer.train()
    logged = [row for row in trainer.state.log_history if "diagnostics/layer_0/rho" in row]
    assert [row["step"] for row in logged] == [1, 2]
    assert set(logged[0]) >= {f"diagnostics/layer_{i}/{q}" for i in range(3) for q in ("rho", "norm_x")}
    assert model.training  # the callback put the model back in training mode
    with pytest.raises(ValueError, match="unknown diagnostics"):
        training.diagnostics_callback(ids, quantities=("entropy",))


def test_ablation_variants_match_independent_evaluations(ids):
    model = make_tiny("gpt2", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    windows = torch.cat([ids, ids.flip(1)])
    result = ablation.run_ablation(model, windows, layerwise=True, n_boot=500)
    rows = {(r["variant"], r["layer"]): r for r in result["rows"]}
    assert len(rows) == 4 * (1 + 3)
    full = perplexity(model, windows)["nll"]
    assert result["full_loss"] == pytest.approx(full)
    projected = perplexity(ht.patch(make_tiny("gpt2", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
                                    ht.TangentConfig(update="projected")), windows)["nll"]
    assert rows[("tangential_only", "all")]["loss"] == pytest.approx(projected, rel=1e-6)
    assert rows[("tangential_only", "all")]["increase"] == pytest.approx(projected - full, rel=1e-5)
    # attention zeroed in layer 1 by hand, as an independent check of the hook
    layer = model.transformer.h[1]
    handle = layer.attn.register_forward_hook(lambda m, a, o: (torch.zeros_like(o[0]),) + tuple(o[1:]))
    zeroed = perplexity(model, windows)["nll"]
    handle.remove()
    assert rows[("attention_zero", 1)]["loss"] == pytest.approx(zeroed, rel=1e-6)
    for r in rows.values():
        assert r["ci_low"] <= r["increase"] <= r["ci_high"]
    assert ht.get_config(model) is None and all(not m._forward_hooks for m in model.modules())


def test_paired_bootstrap_interval_is_centred_and_shrinks():
    g = torch.Generator().manual_seed(1)
    diffs = torch.randn(400, generator=g, dtype=torch.float64) + 2.0
    low, high = ablation.paired_bootstrap(diffs)
    se = diffs.std().item() / 20
    assert low < diffs.mean().item() < high
    assert high - low == pytest.approx(2 * 1.96 * se, rel=0.15)


def test_diagnose_and_ablate_cli(tiny_lm_folder, austen_dir, tmp_path, capsys):
    common = ["--model", str(tiny_lm_folder), "--text-files", str(austen_dir / "emma.txt"), "--seq-len", "32",
              "--max-windows", "2"]
    assert cli.main(["diagnose", *common, "--update", "projected", "--output-dir", str(tmp_path / "d")]) == 0
    report = json.loads((tmp_path / "d" / "report.json").read_text())
    assert len(report["layers"]) == 2 and report["layers"][0]["orthogonality_error"]["max"] < 1e-4
    assert (tmp_path / "d" / "diagnostics_layers.png").stat().st_size > 1000
    assert cli.main(["ablate", *common, "--layerwise", "--output-dir", str(tmp_path / "a")]) == 0
    report = json.loads((tmp_path / "a" / "report.json").read_text())
    assert len(report["rows"]) == 4 * 3
    assert (tmp_path / "a" / "ablation_heatmap.png").is_file() and (tmp_path / "a" / "ablation_bars.png").is_file()
    assert cli.main(["diagnose", *common[:4], "--seq-len", "100", "--output-dir", str(tmp_path / "x")]) == 2
    assert "exceeds the model's context of 64 tokens" in capsys.readouterr().err
