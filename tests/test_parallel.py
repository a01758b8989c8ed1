"""C_l against a direct computation, conversion schedules, the fused parallel path, sweep, speed."""

import copy
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import make_tiny, spec_of

import hf_tangent as ht
from hf_tangent import cli
from hf_tangent.analysis import parallel


def tiny(arch="llama", seed=0):
    model = make_tiny(arch, seed=seed)
    with torch.no_grad():  # non-trivial norm weights, so folding them into the fused GEMM matters
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.core
def test_sensitivity_matches_direct_computation(ids):
    model = tiny("gpt2")
    windows = torch.cat([ids, ids.flip(1)])  # (4, 12)
    result = parallel.sensitivity(model, windows, batch_size=3)
    spec = spec_of(model)
    for k, layer in enumerate(spec.decoder_layers(model)):
        rec = {}
        h1 = layer.register_forward_pre_hook(lambda m, a, kw, rec=rec: rec.__setitem__("h", a[0] if a else kw["hidden_states"]),
                                             with_kwargs=True)
        h2 = layer.mlp.register_forward_hook(lambda m, a, o, rec=rec: rec.__setitem__("y", o))
        with torch.no_grad():
            model(windows)
            h1.remove()
            h2.remove()
            y_parallel = layer.mlp(layer.ln_2(rec["h"])).double()
        y = rec["y"].double()
        c = (y - y_parallel).norm(dim=-1) / (y.norm(dim=-1) + 1e-6)  # (4, 12)
        row = result["layers"][k]
        assert row["c"] == pytest.approx(c.mean().item(), rel=1e-5)
        assert row["window_mean"] == pytest.approx(c.mean(dim=1).mean().item(), rel=1e-5)
        assert row["window_std"] == pytest.approx(c.mean(dim=1).std(unbiased=False).item(), rel=1e-4, abs=1e-7)
    assert result["scores"] == [r["c"] for r in result["layers"]]


def test_sensitivity_on_parallel_neox_says_nothing_to_convert(ids):
    model = make_tiny("gpt_neox_parallel")
    result = parallel.sensitivity(model, ids)
    assert result["already_parallel"] == [0, 1, 2] and result["scores"] == [None, None, None]
    with pytest.raises(ValueError, match="already a parallel-residual block .*nothing to convert"):
        ht.parallelize(model, schedule="low_c", n=1, scores=result["scores"])


def test_schedules_pick_the_right_layers_and_keep_gates(ids):
    scores = [0.5, 0.1, 0.9]
    assert parallel.schedule_layers(scores, 2, "low_c") == [0, 1]
    assert parallel.schedule_layers(scores, 1, "high_c") == [2]
    with pytest.raises(ValueError, match=r"n=4 layers to convert, but the model has 3 convertible layers \(accepted: 0..3\)"):
        parallel.schedule_layers(scores, 4, "low_c")
    with pytest.raises(ValueError, match="unknown schedule 'fast'"):
        parallel.schedule_layers(scores, 1, "fast")
    model = ht.patch(tiny(), ht.TangentConfig(update="projected", gates=True))
    with torch.no_grad():
        ht.tangent_layers(model)[2].gate.fill_(0.7)
    ht.parallelize(model, schedule="low_c", n=2, scores=scores)
    config = ht.get_config(model)
    assert config.parallel_layers == (0, 1) and config.update == "projected"
    assert ht.tangent_layers(model)[2].gate.item() == pytest.approx(0.7)
    ht.parallelize(model, schedule="low_c", n=1, windows=ids)  # scores computed on the fly
    assert len(ht.get_config(model).parallel_layers) == 1


@pytest.mark.core
def test_converting_zero_layers_is_bit_identical(ids):
    model = tiny()
    with torch.no_grad():
        reference = model(ids).logits
        assert torch.equal(ht.parallelize(model, layers=[])(ids).logits, reference)


@pytest.mark.core
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_fused_parallel_path_equals_hook_conversion(arch, ids):
    hooks = ht.patch(tiny(arch), ht.TangentConfig(parallel_layers=[0, 2], update="soft", beta=0.5))
    fused = ht.patch(tiny(arch), ht.TangentConfig(parallel_layers=[0, 2], update="soft", beta=0.5,
                                                 parallel_execution="fused"))
    assert type(fused.model.layers[0].self_attn.q_proj).__name__ == "FusedProjection"  # the fused path is really on
    with torch.no_grad():
        a, b = hooks(ids).logits, fused(ids).logits
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * a.abs().max().item())
    assert not torch.equal(a, tiny(arch)(ids).logits)
    # hidden states: same number, each close
    with torch.no_grad():
        hs_a = hooks(ids, output_hidden_states=True).hidden_states
        hs_b = fused(ids, output_hidden_states=True).hidden_states
    assert len(hs_a) == len(hs_b) == 4
    for x, y in zip(hs_a, hs_b, strict=True):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5 * x.abs().max().item())
    # KV-cache generation: same greedy tokens with and without cache, and as the hook path
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = fused.generate(ids, use_cache=True, **kwargs)
        assert torch.equal(cached, fused.generate(ids, use_cache=False, **kwargs))
        assert torch.equal(cached, hooks.generate(ids, **kwargs))
    assert all(child.fused_execution.linked() for child in ht.tangent_layers(fused) if child.parallel)
    ht.unpatch(fused)
    layer, plain = fused.model.layers[0], tiny(arch).model.layers[0]
    for name, module in layer.named_modules():
        assert type(module) is type(plain.get_submodule(name)), name
    for name in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "mlp.up_proj"):
        assert not {"forward", "_fused_parallel", "_fused_group"} & set(vars(layer.get_submodule(name))), name
    with torch.no_grad():
        assert torch.equal(fused(ids).logits, tiny(arch)(ids).logits)


@pytest.mark.core
def test_fused_parallel_path_trains_the_original_weights_with_checkpointing(ids):
    grads = {}
    for mode in ("hooks", "fused", "fused+checkpointing"):
        model = ht.patch(tiny(), ht.TangentConfig(parallel_layers=[1], parallel_execution=mode.split("+")[0]))
        model.train()
        if "checkpointing" in mode:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model(ids, labels=ids).loss.backward()
        grads[mode] = {n: p.grad for n, p in model.named_parameters()}
    for mode in ("fused", "fused+checkpointing"):
        for name, g in grads["hooks"].items():
            torch.testing.assert_close(grads[mode][name], g, rtol=1e-4, atol=1e-6 * max(1.0, g.abs().max().item()),
                                       msg=f"{mode}: {name}")
    model = ht.patch(tiny(), ht.TangentConfig(parallel_layers=[1], parallel_execution="fused"))
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone.model.layers[1].self_attn.q_proj.weight.mul_(2.0)  # the clone's cache must notice, the original not
        assert not torch.equal(clone(ids).logits, model(ids).logits)


@pytest.mark.core
def test_fused_parallel_save_reload_in_fresh_process(tmp_path, ids):
    model = ht.patch(tiny(), ht.TangentConfig(parallel_layers=[0, 1], parallel_execution="fused", update="projected"))
    model.save_pretrained(tmp_path / "m")
    torch.save(ids, tmp_path / "ids.pt")
    with torch.no_grad():
        expected = model(ids).logits
    script = textwrap.dedent(f"""
        import torch, hf_tangent as ht
        m = ht.from_pretrained({str(tmp_path / 'm')!r}).eval()
        assert ht.get_config(m).parallel_layers == (0, 1) and ht.get_config(m).parallel_execution == "fused"
        with torch.no_grad():
            torch.save(m(torch.load({str(tmp_path / 'ids.pt')!r})).logits, {str(tmp_path / 'out.pt')!r})
        assert [c.fused_execution.linked() for c in ht.tangent_layers(m) if c.parallel] == [True, True]
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert torch.equal(torch.load(tmp_path / "out.pt"), expected)


def test_fused_parallel_path_refuses_unsupported_blocks():
    with pytest.raises(ValueError, match="model_type 'gpt2' has no fused parallel execution path"):
        ht.patch(tiny("gpt2"), ht.TangentConfig(parallel_layers=[0], parallel_execution="fused"))
    with pytest.raises(ValueError, match="TangentConfig.parallel_execution='async' is not one of the choices; accepted: one of 'hooks', 'fused'"):
        ht.TangentConfig(parallel_execution="async")


def test_sweep_greedy_and_recommendation(ids):
    model = tiny()
    calibration, heldout = ids[:1], ids[1:]
    scores = parallel.sensitivity(model, calibration)["scores"]
    greedy = parallel.greedy_order(model, calibration)
    assert sorted(step["layer"] for step in greedy) == [0, 1, 2]
    first = greedy[0]
    single = [parallel._with_layers(model, [i], calibration, 1) for i in range(3)]
    assert single[first["layer"]] == min(single)  # greedy step 1 is the cheapest single conversion
    sweep = parallel.sweep_losses(model, heldout, scores=scores, random_seeds=(0, 1), greedy=greedy)
    assert sweep["ks"] == [0, 1, 2, 3]
    assert all(sweep["curves"][s][0] == 0.0 for s in ("low_c", "high_c", "random", "greedy"))
    full = [r for r in sweep["rows"] if r["k"] == 3]
    assert len({round(r["loss"], 9) for r in full}) == 1  # every schedule converts all layers at k = L
    rec = parallel.recommend(model, calibration, heldout, budget=1e9, order=[g["layer"] for g in greedy])
    assert rec["k"] == 3
    rec = parallel.recommend(model, calibration, heldout, budget=-1.0, order=[0, 1, 2])
    assert rec["k"] == 0 and rec["heldout_increase"] == 0.0
    with pytest.raises(ValueError, match=r"k values \[5\] out of range"):
        parallel.sweep_losses(model, heldout, scores=scores, ks=[5])
    with pytest.raises(ValueError, match="no calibration windows"):
        parallel.sensitivity(model, ids[:0])


def test_random_schedule_draws_uniformly_from_the_convertible_layers():
    from collections import Counter

    scores = [0.5, None, 0.1, 0.9]  # layer 1 is already a parallel block
    draws = Counter(tuple(parallel.schedule_layers(scores, 2, "random", seed=s)) for s in range(300))
    assert set(draws) == {(0, 2), (0, 3), (2, 3)}
    assert all(60 <= n <= 140 for n in draws.values()), draws  # 100 expected each (sd 8.2)


def test_random_schedule_is_deterministic_per_seed():
    scores = [0.5, 0.1, 0.9, 0.3, 0.7]
    assert parallel.schedule_layers(scores, 3, "random", seed=3) == parallel.schedule_layers(scores, 3, "random", seed=3)


def test_submodule_times_on_a_fake_clock(ids):
    """A clock that advances 1 s per reading: each module's time is its own pre-hook -> hook span, so a module
    that contains timed modules spans their readings too (attention: q, k, v; FFN: gate, up); the forward is
    timed without hooks (2 readings per call)."""
    ticks = iter(range(10_000))
    times = parallel.submodule_times(tiny(), ids, repeats=2, clock=lambda: float(next(ticks)))
    assert [(r["layer"], r["t_attention"], r["t_ffn"], r["t_ffn_norm"], r["t_projections"]) for r in times["layers"]] == \
        [(i, 7.0, 5.0, 1.0, [1.0] * 5) for i in range(3)]
    assert times["t_forward"] == 1.0 and times["calls"] == 2 * len(ids)  # repeats x windows
    assert times["t_gemm_call"] == pytest.approx(1.0) and times["fused_groups"] == 2  # equal times: all intercept


def test_speed_estimate_models_the_fused_build():
    """Saved per converted layer: the FFN norm and (5 projections - 2 GEMMs) per-call GEMM costs."""
    rows = [{"layer": i, "t_ffn_norm": 0.01 * (i + 1), "t_projections": [0.1] * 5} for i in range(3)]
    times = {"layers": rows, "t_forward": 2.0, "fused_groups": 2, "t_gemm_call": 0.05}
    assert parallel.estimated_speedup(times, [0, 2]) == pytest.approx(2.0 / (2.0 - (0.01 + 0.15) - (0.03 + 0.15)))
    assert parallel.estimated_speedup(times, []) == 1.0
    assert parallel.estimated_speedup(times | {"fused_groups": 0}, [0, 2]) == 1.0  # no fused path: the same work
    gpt2 = parallel.submodule_times(tiny("gpt2"), torch.zeros(1, 4, dtype=torch.long), repeats=1)
    assert gpt2["fused_groups"] == 0 and parallel.estimated_speedup(gpt2, [0]) == 1.0


def test_gemm_call_cost_is_the_intercept_of_the_projection_times(ids):
    """A clock that charges each projection 3 us + 1 ns per weight element and everything else nothing: the
    fitted per-call cost is 3 us."""
    model, now = tiny(), [0.0]
    for layer in model.model.layers:
        for path in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            module = layer.get_submodule(path)
            module.register_forward_hook(lambda m, a, o: now.__setitem__(0, now[0] + 3e-6 + 1e-9 * m.weight.numel()))
    times = parallel.submodule_times(model, ids, repeats=1, clock=lambda: now[0])
    assert times["t_gemm_call"] == pytest.approx(3e-6, rel=1e-6)


def test_sensitivity_and_sweep_cli(tiny_lm_folder, austen_dir, tmp_path, capsys):
    calibration = ["--model", str(tiny_lm_folder), "--calibration-files", str(austen_dir / "prideprejudice.txt"),
                   "--seq-len", "32", "--max-windows", "2"]
    assert cli.main(["sensitivity", *calibration, "--output-dir", str(tmp_path / "s")]) == 0
    report = json.loads((tmp_path / "s" / "report.json").read_text())
    assert len(report["layers"]) == 2 and all(r["c"] >= 0 for r in report["layers"])
    assert report["text"] == str(austen_dir / "prideprejudice.txt")
    with pytest.raises(SystemExit):  # sensitivity evaluates nothing: it has no evaluation-text option to ignore
        cli.main(["sensitivity", *calibration, "--text-files", str(austen_dir / "emma.txt")])
    assert "unrecognized arguments: --text-files" in capsys.readouterr().err
    common = [*calibration, "--text-files", str(austen_dir / "emma.txt")]
    assert cli.main(["parallel-sweep", *common, "--calibration-windows", "1", "--budget", "1000",
                     "--output-dir", str(tmp_path / "p")]) == 0
    report = json.loads((tmp_path / "p" / "report.json").read_text())
    assert report["recommendations"]["greedy"]["k"] == 2
    assert set(report["speed"]["measured_speedup"]) == {"hooks", "fused"}
    assert (tmp_path / "p" / "parallel_sweep.png").is_file()
