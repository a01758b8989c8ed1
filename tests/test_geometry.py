"""Residual geometry (geometry.py): critical directions and tangent Jacobians on fields with known
answers, the reduced attention field against the weights and against the model's own forward, FFN
Jacobians against finite differences, attention pressure against a hand-computed uniform average."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny

import hf_tangent as ht
from hf_tangent import cli
from hf_tangent.analysis import geometry
from hf_tangent.analysis.stats import spearman
from hf_tangent.experiments.report import Report


def _symmetric(d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g))
    m = torch.tensor([3.0, 2.0, 1.0, -0.5, -1.0, -2.0])[:d]  # no 0: F = 0 there, the score undefined
    return q, m, q @ torch.diag(m) @ q.T


def test_linear_field_critical_directions_and_spectra():
    # F(u) = M u, M symmetric: g = P_u M u vanishes exactly at the eigenvectors +-q_k, and there
    # J = P (M - m_k I) P has eigenvalues m_j - m_k (j != k): top attractor, bottom repeller.
    q, m, matrix = _symmetric()
    field = lambda u: u @ matrix.T  # noqa: E731
    found = geometry.find_critical(field, torch.randn(96, 6, generator=torch.Generator().manual_seed(1)),
                                   max_refined=32, threshold=1e-4)
    directions = found["directions"]
    assert len(directions) == 12  # +-q_k for 6 eigenvectors, each found once
    assert found["scores"].max() < 1e-4
    for c, u in zip(geometry.analyse_critical(field, directions), directions, strict=True):
        k = int((q.T @ u).abs().argmax())
        assert (q[:, k] @ u).abs().item() == pytest.approx(1.0, abs=1e-5)
        assert c["rho"] == pytest.approx(m[k].item(), abs=1e-4)
        expected = sorted((m[j] - m[k]).item() for j in range(6) if j != k)
        assert sorted(z.real for z in c["eigenvalues"].tolist()) == pytest.approx(expected, abs=1e-3)
        assert c["label"] == {0: "attractor", 5: "repeller"}.get(k, "saddle")


def test_rotational_field_is_neutral():
    # F(u) = (I + S) u with S skew and S e = 0: +-e are critical, rho = 1, J = Q^T S Q is skew:
    # purely imaginary eigenvalues in complex pairs, label neutral.
    e = torch.tensor([0.0, 0.0, 0.0, 1.0])
    s = torch.zeros(4, 4)
    s[0, 1], s[1, 0], s[0, 2], s[2, 0] = 2.0, -2.0, 1.0, -1.0
    field = lambda u: u @ (torch.eye(4) + s).T  # noqa: E731
    (c,) = geometry.analyse_critical(field, e[None])
    assert c["rho"] == pytest.approx(1.0)
    assert c["label"] == "neutral" and c["complex_pairs"] == 1 and abs(c["max_real"]) < 1e-9


def test_batched_jacobian_matches_finite_differences():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5)).double()
    x = torch.randn(3, 5, dtype=torch.float64)
    jac = geometry.batched_jacobian(net, x)
    h = 1e-6
    for n in range(3):
        fd = torch.stack([(net(x[n] + h * e) - net(x[n] - h * e)) / (2 * h) for e in torch.eye(5, dtype=torch.float64)], 1)
        assert torch.allclose(jac[n], fd, atol=1e-8)


def test_attention_field_is_ov_of_the_input_norm():
    # Independent computation from the weights: O V N_1(u) (GQA heads repeated), and GPT-2 with biases.
    u = geometry.unit(torch.randn(5, 64, generator=torch.Generator().manual_seed(2)))
    llama = make_tiny("llama")
    layer = llama.model.layers[1]
    v = layer.self_attn.v_proj(layer.input_layernorm(u)).view(5, 2, 16)
    expected = layer.self_attn.o_proj(v.repeat_interleave(2, dim=1).reshape(5, 64))
    assert torch.allclose(geometry.LayerFields(llama, 1).attention(u), expected, atol=1e-5)
    gpt2 = make_tiny("gpt2")
    block = gpt2.transformer.h[2]
    value = block.attn.c_attn(block.ln_1(u))[:, 128:]
    assert torch.allclose(geometry.LayerFields(gpt2, 2).attention(u), block.attn.c_proj(value), atol=1e-5)


def test_attention_field_is_attention_on_a_sequence_sitting_at_u():
    # Every token of a 7-token sequence at the same direction: each attention output row is F_A(u).
    model = make_tiny("mistral")
    u = geometry.unit(torch.randn(64, generator=torch.Generator().manual_seed(3)))
    seen = {}
    handle = model.model.layers[0].self_attn.register_forward_hook(lambda m, a, o: seen.update(a=o[0]))
    with torch.no_grad():
        model(inputs_embeds=u.expand(1, 7, 64))
    handle.remove()
    expected = geometry.LayerFields(model, 0).attention(u[None])[0]
    assert torch.allclose(seen["a"][0], expected.expand(7, 64), atol=1e-5)


def _two_close_eigenvalues(d=8, seed=0):
    """A non-symmetric M with real eigenvalues 3.0 and 2.94 (2 % apart), the rest well apart."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(d, d, generator=g, dtype=torch.float64)
    values = torch.tensor([3.0, 2.94, 1.0, 0.4, -0.5, -1.0, -1.7, -2.5], dtype=torch.float64)[:d]
    return basis @ torch.diag(values) @ torch.linalg.inv(basis), basis, values


def test_refined_roots_of_a_field_with_two_eigenvalues_2_percent_apart_are_exactly_its_eigenvectors():
    """The paper's threshold (0.05) accepts whole arcs between eigenvectors whose eigenvalues are close;
    refined to convergence the roots are exactly the eigenvector lines, each found, none extra."""
    matrix, basis, values = _two_close_eigenvalues()
    field = lambda u: u @ matrix.T  # noqa: E731
    truth = geometry.unit(basis.T)  # (8, d): the eigenvectors
    starts = torch.randn(200, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    u, scores, outcome, _ = geometry.newton_roots(field, starts, tol=1e-10, max_iter=60)
    converged = outcome == 0
    assert converged.sum() > 100
    roots = u[converged][geometry.distinct_roots(u[converged], scores[converged], odd=True)]
    cos = (roots @ truth.T).abs()
    assert len(roots) == 8 and (1 - cos.max(dim=1).values).max() < 1e-12  # every root is an eigenvector line
    assert (1 - cos.max(dim=0).values).max() < 1e-12  # every eigenvector line is found
    # the paper's protocol at 0.05 keeps directions that are no root: some candidates sit far from every eigenvector
    found = geometry.find_critical(lambda v: v @ matrix.float().T, starts.float(), threshold=0.05, max_refined=0, refine=0)
    far = 1 - (geometry.unit(found["directions"].double()) @ truth.T).abs().max(dim=1).values
    assert far.max() > 1e-3


def test_exact_critical_set_of_a_linear_field():
    """linear_critical: isolated roots = simple real eigenvalues, spectra {lambda_j - lambda_k}, types by
    sign; a kernel and a repeated eigenvalue are degenerate sets reported by their dimension."""
    matrix, basis, values = _two_close_eigenvalues()
    exact = geometry.linear_critical(matrix)
    assert [round(r["rho"], 9) for r in exact["isolated"]] == sorted(values.tolist(), reverse=True)
    for r, k in zip(exact["isolated"], torch.argsort(values, descending=True).tolist(), strict=True):
        expected = sorted((values[j] - values[k]).item() for j in range(8) if j != k)
        assert sorted(z.real for z in r["spectrum"].tolist()) == pytest.approx(expected, abs=1e-9)
        assert r["label"] == ("attractor" if k == 0 else "repeller" if k == 7 else "saddle")
        assert r["margin"] == pytest.approx(min(abs(e) for e in expected), abs=1e-9) and not r["flagged"]
    # rank 5 of 8 with a repeated eigenvalue: kernel of dimension 3, a 2-dimensional eigenspace, 1 isolated root
    low = basis @ torch.diag(torch.tensor([2.0, 2.0, -1.0, 0, 0, 0, 0.5, 0], dtype=torch.float64))[:, :8] @ \
        torch.linalg.inv(basis)
    exact = geometry.linear_critical(low)
    assert exact["rank"] == 4 and len(exact["isolated"]) == 2
    assert sorted((d["dimension"], d["kernel"]) for d in exact["degenerate"]) == [(2, False), (4, True)]


def test_types_by_sign_with_the_margin_and_the_rounding_flag():
    exact_saddle = geometry.classify_by_sign(torch.tensor([-2.0, 1e-3, -0.5], dtype=torch.float64), 1e-9)
    assert exact_saddle["label"] == "saddle" and exact_saddle["margin"] == pytest.approx(1e-3) and not exact_saddle["flagged"]
    # a relative tolerance (the paper protocol's 1 %) would call it an attractor: the sign rule does not
    assert geometry.classify(torch.tensor([-2.0, 1e-3, -0.5]), rel_tol=1e-2)["label"] == "attractor"
    at_rounding = geometry.classify_by_sign(torch.tensor([-2.0, 1e-15], dtype=torch.float64), 1e-12)
    assert at_rounding["label"] == "saddle" and at_rounding["flagged"]


def test_odd_fields_and_linear_maps_are_detected():
    model = make_tiny("llama")
    fields = geometry.LayerFields(model, 1, dtype=torch.float64)
    assert geometry.is_odd(fields.attention, 64) and not geometry.is_odd(fields.ffn, 64)
    matrix, residual = geometry.linear_map(fields.attention, 64)
    assert residual < 1e-12  # RMSNorm and no biases: F_A(u) = M u on the sphere, to float64 rounding
    gpt2 = make_tiny("gpt2")  # LayerNorm: not linear on the sphere (it subtracts the mean); odd while biases are 0
    fields = geometry.LayerFields(gpt2, 1, dtype=torch.float64)
    assert geometry.linear_map(fields.attention, 64)[1] > 1e-3 and geometry.is_odd(fields.attention, 64)
    with torch.no_grad():
        gpt2.transformer.h[1].attn.c_proj.bias.fill_(0.1)
    assert not geometry.is_odd(geometry.LayerFields(gpt2, 1, dtype=torch.float64).attention, 64)


def _independent_ov(layer, eps, heads_per_kv):
    """M = W_O W_V (kv heads repeated) diag(g) / sqrt(1/d + eps), from a Llama layer's weights."""
    attn, g = layer.self_attn, layer.input_layernorm.weight.double()
    d = g.shape[0]
    w_v = attn.v_proj.weight.double()  # (kv * head_dim, d)
    head_dim = attn.head_dim
    w_v = w_v.view(-1, head_dim, d).repeat_interleave(heads_per_kv, dim=0).reshape(-1, d)
    return attn.o_proj.weight.double() @ w_v @ torch.diag(g) / (1 / d + eps) ** 0.5


def _check_ov_roots(report_layer, directions, matrix):
    """Every reported OV root is an eigenvector line of `matrix` (1 - |cos| < 1e-6) with rho its eigenvalue
    and the type the signs of {lambda_j - lambda_k} give."""
    values, vectors = torch.linalg.eig(matrix)
    roots = report_layer["roots"]
    assert len(roots) == len(directions) > 0
    for root, u in zip(roots, directions.double(), strict=True):
        k = int(((vectors.real.T @ u).abs() / vectors.real.norm(dim=0)).argmax())
        assert 1 - abs(torch.dot(geometry.unit(vectors[:, k].real), u).item()) < 1e-6
        assert root["rho"] == pytest.approx(values[k].real.item(), rel=1e-6, abs=1e-9)
        others = torch.cat([values[:k], values[k + 1:]]) - values[k]
        positive, negative = int((others.real > 0).sum()), int((others.real < 0).sum())
        expected = "saddle" if positive and negative else "attractor" if negative else "repeller"
        assert (root["label"], root["positive"], root["negative"]) == (expected, positive, negative)


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox_parallel", "llama", "mistral"])
def test_refined_critical_directions_on_every_architecture(arch):
    """The path taken per field (exact for the OV field of RMSNorm models without biases, the search
    elsewhere) and, for every root reported, an independent zero score below 1e-6 from the layer's own
    forward (Llama / Mistral: the OV roots against M from the weights)."""
    model = make_tiny(arch)
    result = geometry.critical_directions(model, 1, torch.zeros(0, 64), random_starts=16, steps=150, threshold=0.2)
    linear = arch in ("llama", "mistral")
    assert result["fields"]["attention"]["path"].startswith("exact") == linear
    assert result["fields"]["ffn"]["path"] == result["fields"]["full"]["path"] == "search"
    layer = model.model.layers[1] if linear else None
    if linear:
        _check_ov_roots(result["fields"]["attention"], result["fields"]["attention"]["directions"],
                        _independent_ov(layer, model.config.rms_norm_eps, 2))
    fields = geometry.LayerFields(model, 1)  # float32, the model's own replay
    assert sum(len(found["directions"]) for found in result["fields"].values()) > 0  # something to check
    for name, found in result["fields"].items():
        assert found["refined"] == found["converged"] + found["stalled"] + found["unfinished"] \
            if found["path"] == "search" else True
        for u in found["directions"]:
            value = fields.field(name)(u[None].float())
            assert geometry.zero_score(value, u[None].float()).item() < 1e-5  # float32 replay: 1e-6 in float64


@pytest.fixture(scope="module")
def smollm2():
    from hf_tangent.artifacts.models import load_model

    return load_model("smollm2-135m")


def test_ov_critical_directions_of_a_real_smollm2_layer_at_the_default_settings(smollm2):
    """Default settings (32 random + 32 token starts, 300 steps, threshold 0.05, tol 1e-8) on layer 3 of
    SmolLM2-135M: every OV root against M from the weights, and the search's own roots all on them."""
    model, tokenizer = smollm2
    report = ht.critical(model, tokenizer, layers=[3], fields=["attention"], seq_len=256, max_windows=2, progress=False)
    attention = report["layers"][0]["fields"]["attention"]
    _check_ov_roots(attention, report.tensors["layer3.attention"],
                    _independent_ov(model.model.layers[3], model.config.rms_norm_eps, 3))
    check = attention["check"]
    assert check["matched"] == check["search_roots"] > 0  # every root the search refined is an exact one


@pytest.mark.slow
def test_full_field_roots_of_a_real_smollm2_layer_at_the_default_settings(smollm2):
    """Every full-field root's zero score recomputed independently (M from the weights plus a float64
    copy of the layer's norm and MLP), and the search's counts add up (about a minute). Layer 28: the
    kept run finds full-field roots there (most layers have none, which would leave nothing to check)."""
    model, tokenizer = smollm2
    report = ht.critical(model, tokenizer, layers=[28], fields=["full"], seq_len=256, max_windows=2, progress=False)
    layer = model.model.layers[28]
    matrix = _independent_ov(layer, model.config.rms_norm_eps, heads_per_kv=3)
    norm, mlp = [__import__("copy").deepcopy(m).double() for m in (layer.post_attention_layernorm, layer.mlp)]
    assert len(report.tensors["layer28.full"]) > 0
    for u in report.tensors["layer28.full"].double():
        value = u @ matrix.T + mlp(norm(u[None]))[0]
        assert geometry.zero_score(value[None], u[None]).item() < 1e-6
    full = report["layers"][0]["fields"]["full"]
    assert full["refined"] == full["below_threshold"] - full["merged_before_refining"]
    assert full["converged"] + full["stalled"] + full["unfinished"] == full["refined"]


def test_the_search_is_deterministic_per_seed():
    model = make_tiny("llama")
    tokens = geometry.unit(torch.randn(4, 64, generator=torch.Generator().manual_seed(9)))
    run = lambda seed: geometry.critical_directions(model, 0, tokens, random_starts=6, steps=60, threshold=0.3,  # noqa: E731
                                                    fields=("ffn",), seed=seed, protocol="paper")["fields"]["ffn"]
    first, again, other = run(0), run(0), run(1)
    assert first["converged"] > 0 and torch.equal(first["directions"], again["directions"])
    assert [c["score"] for c in first["roots"]] == [c["score"] for c in again["roots"]]
    assert not torch.equal(first["directions"], other["directions"])


def test_fields_refuse_a_patched_model_and_bad_input():
    model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected"))
    with pytest.raises(ValueError, match="unpatched model"):
        geometry.LayerFields(model, 0)
    with pytest.raises(ValueError, match=r"out of range; accepted: 0..2"):
        geometry.LayerFields(make_tiny("llama"), 3)
    with pytest.raises(ValueError, match="unknown field 'mlp'; accepted: attention, ffn, full"):
        geometry.LayerFields(make_tiny("llama"), 0).field("mlp")


def test_ffn_probe_against_finite_differences_and_silu():
    model = make_tiny("llama")
    probe = geometry.FfnProbe(model, 1)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4)) * 7
    measured = probe.measure(x, top_k=128)
    mlp, norm = model.model.layers[1].mlp, model.model.layers[1].post_attention_layernorm
    phi = lambda v: mlp(norm(v)).double()  # noqa: E731
    for n in range(3):
        r, u = x[n].norm().double(), geometry.unit(x[n].double())
        basis = geometry.tangent_basis(u)
        h = 1e-3
        cols = [(phi((x[n] + h * b.float())[None]) - phi((x[n] - h * b.float())[None]))[0] / (2 * h) for b in basis.T]
        fd = torch.stack(cols, 1)  # DPhi Q
        s = torch.linalg.svdvals(basis.T @ fd * r)
        assert measured["spectral_norm"][n].item() == pytest.approx(s[0].item(), rel=2e-3)
        assert measured["radial_fraction"][n].item() == pytest.approx(((u @ fd).pow(2).sum() / fd.pow(2).sum()).item(), rel=1e-2, abs=1e-5)
    z = mlp.gate_proj(norm(x))
    sig = torch.sigmoid(z)
    assert torch.allclose(measured["gain"], sig * (1 + z * (1 - sig)), atol=1e-5)  # silu'(z)
    assert torch.allclose(measured["top_share"], torch.ones(3), atol=1e-4)  # all 128 units: shares sum to 1 (no bias)


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox_parallel", "llama", "mistral"])
def test_keys_values_view_is_exact_on_every_architecture(arch):
    # sum_j a_j v_j + b = y, so the units' shares of P_u y plus the bias's share make exactly 1
    # (GPT-2's Conv1D stores the value matrix transposed; GPT-2 and GPT-NeoX have a bias).
    model = make_tiny(arch)
    probe = geometry.FfnProbe(model, 2)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(7)) * 3
    width = geometry.value_matrix(probe.down).shape[1]
    measured = probe.measure(x, top_k=width)
    with torch.no_grad():
        y = probe.mlp(probe.norm(x))
    tangent_y = geometry.project(y, geometry.unit(x))
    bias = probe.down.bias if probe.down.bias is not None else torch.zeros(64)
    bias_share = (tangent_y @ bias) / tangent_y.pow(2).sum(-1)
    assert torch.allclose(measured["top_share"] + bias_share, torch.ones(4), atol=1e-4)
    assert measured["gain"].shape == (4, width) and (measured["spectral_norm"] > 0).all()


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox_parallel", "llama", "mistral"])
def test_pressure_changes_every_architecture(arch):
    model = make_tiny(arch)
    windows = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(8))
    rows = geometry.pressure_diversity(model, windows, [1.0, 0.0], ["full"])  # raises if the knob had no effect
    assert {r["factor"] for r in rows} == {1.0, 0.0} and len(rows) == 6


def test_gain_regimes_and_spearman():
    regimes = geometry.gain_regimes(torch.tensor([0.0, 0.05, 1.0, 0.95, 0.5, -0.3]))
    assert regimes == pytest.approx({"off": 2 / 6, "linear": 2 / 6, "transition": 2 / 6})
    assert spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 2, 3], [4, 3, 3, 1]) == pytest.approx(-1.0)  # ties: average ranks
    assert spearman([1, 2], [2, 1]) is None and spearman([1, 1, 1], [1, 2, 3]) is None


def test_attention_pressure_zero_is_the_causal_mean_of_values_and_restores():
    model = make_tiny("llama")
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(5))
    attention = model.model.layers[0].self_attn
    seen = {}
    handles = [attention.v_proj.register_forward_hook(lambda m, a, o: seen.__setitem__("v", o)),
               attention.o_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("o_in", a[0]))]
    before = attention.scaling
    with torch.no_grad():
        reference = model(ids).logits
        with geometry.attention_pressure(model, 0.0):
            model(ids)
    for h in handles:
        h.remove()
    v = seen["v"].view(1, 9, 2, 16).repeat_interleave(2, dim=2)  # 2 kv heads -> 4 query heads
    causal_mean = v.cumsum(1) / torch.arange(1, 10).view(1, 9, 1, 1)
    assert torch.allclose(seen["o_in"], causal_mean.reshape(1, 9, 64), atol=1e-5)
    assert attention.scaling == before
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference)
    with pytest.raises(RuntimeError, match="boom"), geometry.attention_pressure(model, 0.5):
        raise RuntimeError("boom")
    assert attention.scaling == before
    with pytest.raises(ValueError, match=r"factor=-1; accepted: a number >= 0"):
        with geometry.attention_pressure(model, -1):
            pass


def test_pressure_refuses_attention_without_scaling():
    model = make_tiny("llama")
    del model.model.layers[1].self_attn.scaling
    with pytest.raises(ValueError, match="layer 1's LlamaAttention has no numeric `scaling`"):
        with geometry.attention_pressure(model, 0.5):
            pass


def test_pressure_diversity_rows():
    model = make_tiny("gpt_neox_sequential")
    windows = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(6))
    rows = geometry.pressure_diversity(model, windows, [1.0, 0.0], ["full", "zero_ffn"])
    assert len(rows) == 2 * 2 * 3
    for r in rows:
        if r["variant"] == "zero_ffn":
            assert r["after_ffn"] == pytest.approx(r["after_attention"], abs=1e-6)
    uniform = [r for r in rows if r["factor"] == 0.0 and r["layer"] == 0]
    normal = [r for r in rows if r["factor"] == 1.0 and r["layer"] == 0]
    assert uniform[0]["before_attention"] == pytest.approx(normal[0]["before_attention"])


def test_geometry_commands(tiny_lm_folder, austen_dir, tmp_path, capsys):
    common = ["--model", str(tiny_lm_folder), "--text-files", str(austen_dir / "emma.txt"), "--seq-len", "32",
              "--max-windows", "2"]
    assert cli.main(["critical", *common, "--random-starts", "4", "--token-starts", "4", "--steps", "30",
                     "--threshold", "0.5", "--output-dir", str(tmp_path / "c")]) == 0
    report = json.loads((tmp_path / "c" / "report.json").read_text())
    assert [r["layer"] for r in report["layers"]] == [0, 1] and report["totals"]["full"]["starts"] == 16
    assert (tmp_path / "c" / "critical_labels.png").is_file()
    # the directions file: one float32 tensor per layer and field, unit rows in the report's order
    from safetensors.torch import load_file

    directions = load_file(tmp_path / "c" / "critical_directions.safetensors")
    assert {k for k in directions if not k.endswith(".eigenvalues")} == {
        f"layer{i}.{f}" for i in (0, 1) for f in ("attention", "ffn", "full")}
    # every root's eigenvalue sample is in the file ([roots, k, 2], extremes kept); the JSON keeps the best root's
    for i, row in enumerate(report["layers"]):
        for f, found in row["fields"].items():
            if not found["roots"]:
                assert f"layer{i}.{f}.eigenvalues" not in directions
                continue
            spectra = directions[f"layer{i}.{f}.eigenvalues"]
            assert spectra.shape[:1] == (len(found["roots"]),) and spectra.shape[2] == 2
            for sample, root in zip(spectra, found["roots"], strict=True):
                assert sample[:, 0].max().item() == pytest.approx(root["max_real"], rel=1e-5, abs=1e-6)
                assert sample[:, 0].min().item() == pytest.approx(root["min_real"], rel=1e-5, abs=1e-6)
            kept = [r for r in found["roots"] if "eigenvalues" in r]
            assert kept == [min(found["roots"], key=lambda r: r["score"])]
            best = found["roots"].index(kept[0])
            assert torch.tensor(kept[0]["eigenvalues"]) == pytest.approx(spectra[best].double(), abs=1e-6)
    fields = geometry.LayerFields(__import__("transformers").AutoModelForCausalLM.from_pretrained(tiny_lm_folder), 1,
                                  dtype=torch.float64)
    for f in ("attention", "ffn", "full"):
        rows, roots = directions[f"layer1.{f}"], report["layers"][1]["fields"][f]["roots"]
        assert rows.dtype == torch.float32 and rows.shape == (len(roots), 32)
        assert torch.allclose(rows.norm(dim=-1), torch.ones(len(roots)), atol=1e-6)
        for u, root in zip(rows.double(), roots, strict=True):  # rho recomputed at the saved direction
            assert torch.dot(u, fields.field(f)(u[None])[0]).item() == pytest.approx(root["rho"], rel=1e-4, abs=1e-6)
    assert cli.main(["critical", *common, "--protocol", "paper", "--random-starts", "4", "--token-starts", "0",
                     "--steps", "10", "--threshold", "0.5", "--layers", "1", "--output-dir", str(tmp_path / "cp")]) == 0
    assert "(paper protocol)" in (tmp_path / "cp" / "report.md").read_text()
    assert Report.load(tmp_path / "c" / "report.json").to_markdown() == (tmp_path / "c" / "report.md").read_text()
    assert cli.main(["pressure", *common, "--factors", "1", "0.1", "--output-dir", str(tmp_path / "p")]) == 0
    report = json.loads((tmp_path / "p" / "report.json").read_text())
    assert len(report["summary"]) == 2 * 4 and (tmp_path / "p" / "pressure_curves.png").is_file()
    assert cli.main(["ffn-jacobian", *common, "--tokens", "3", "--output-dir", str(tmp_path / "j")]) == 0
    report = json.loads((tmp_path / "j" / "report.json").read_text())
    assert report["layers"][1]["tokens"] == 3 and report["layers"][1]["c_l"] > 0
    assert Report.load(tmp_path / "j" / "report.json").to_markdown() == (tmp_path / "j" / "report.md").read_text()
    capsys.readouterr()
    assert cli.main(["critical", *common, "--fields", "mlp", "--output-dir", str(tmp_path / "x")]) == 2
    assert "unknown fields ['mlp']; accepted: attention, ffn, full" in capsys.readouterr().err
    assert cli.main(["ffn-jacobian", *common, "--ablation-report", str(tmp_path / "p" / "report.json"),
                     "--output-dir", str(tmp_path / "y")]) == 2
    assert "not an `ablate` report" in capsys.readouterr().err


def test_a_root_the_step_cap_reaches_late_is_refined_to_the_end_and_outcomes_are_told_apart():
    """A cap must not decide whether a root is counted: a row below sphere.BASIN at max_iter goes on (up
    to 4 x max_iter) and converges; a row far from any root at the cap is 'unfinished', not 'stalled'
    (that is: the damped step no longer lowers the residual)."""
    matrix, basis, values = _two_close_eigenvalues()
    field = lambda u: u @ matrix.T  # noqa: E731
    truth = geometry.unit(basis.T)
    near = geometry.unit(truth[:1] + 1e-3 * torch.randn(1, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64))
    u, scores, outcome, iterations = geometry.newton_roots(field, near, tol=1e-14, max_iter=1)
    assert scores[0] < geometry.BASIN and outcome.tolist() == [0] and 1 < iterations[0] <= 4  # went on past the cap
    assert 1 - (u[0] @ truth[0]).abs() < 1e-12
    far = torch.randn(3, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    _, scores, outcome, iterations = geometry.newton_roots(field, far, tol=1e-14, max_iter=1)
    assert (scores > geometry.BASIN).all() and outcome.tolist() == [2, 2, 2] and iterations.tolist() == [1, 1, 1]
    rotation = torch.tensor([[0.0, -1.0], [1.0, 0.0]], dtype=torch.float64)  # F(u) = J u is tangent everywhere: no root
    _, scores, outcome, iterations = geometry.newton_roots(lambda u: u @ rotation.T, torch.tensor([[0.6, 0.8]],
                                                                                                dtype=torch.float64), max_iter=40)
    assert outcome.tolist() == [1] and iterations[0] < 40 and abs(scores[0] - 1) < 1e-12  # stalled: nothing lowers it


def test_spectrum_falls_back_to_numpy_where_torch_does_not_converge(monkeypatch):
    # torch 2.13's MKL gives up on the skew 3x3 above (LinAlgError, error code 3) on some CPUs; the
    # analysis must not: the fallback's eigenvalues equal the closed form 0, +-i sqrt(5).
    j = torch.tensor([[0.0, 0.0, -2.0], [0.0, 0.0, -1.0], [2.0, 1.0, 0.0]], dtype=torch.float64)

    def refuse(*args, **kwargs):
        raise torch.linalg.LinAlgError("did not converge")

    monkeypatch.setattr(torch.linalg, "eigvals", refuse)
    monkeypatch.setattr(torch.linalg, "eig", refuse)
    values = geometry.spectrum(j)
    assert values.dtype == torch.complex128
    expected = sorted([0.0, 5**0.5, -(5**0.5)])
    assert sorted(values.imag.tolist()) == pytest.approx(expected, abs=1e-12)
    assert values.real.abs().max().item() < 1e-12
    vals, vecs = geometry.eigen(j)
    assert torch.allclose(j.to(torch.complex128) @ vecs, vecs * vals, atol=1e-12)
    (c,) = geometry.analyse_critical(lambda u: u @ (torch.eye(4) + _skew()).T, torch.tensor([[0.0, 0.0, 0.0, 1.0]]))
    assert c["label"] == "neutral" and c["complex_pairs"] == 1


def _skew():
    s = torch.zeros(4, 4)
    s[0, 1], s[1, 0], s[0, 2], s[2, 0] = 2.0, -2.0, 1.0, -1.0
    return s
