"""The Triton kernels (implementation="triton") against the reference rules: every rule, float32
and float64 (gradcheck), odd d, several rows per program with a partial last program, x = 0 rows,
gates, both eps modes, the patched model; the cached no-grad launcher (its Python calls pinned);
and under torch.compile the plain torch rule, never an opaque op. Without a GPU the kernels run in
triton's interpreter (conftest sets TRITON_INTERPRET=1); the compile tests need neither."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from conftest import make_tiny

import hf_tangent as ht
from hf_tangent.core import triton_update
from hf_tangent.core.fused import fused_residual_delta
from hf_tangent.core.rules import residual_delta

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
kernels = pytest.mark.skipif(not triton_update.available() or (DEVICE == "cpu" and not triton_update.INTERPRET),
                             reason="the kernels need triton and a GPU or TRITON_INTERPRET=1")

RULES = [("add", {"alpha": 0.7}), ("zero", {}), ("projected", {}), ("soft", {"beta": 0.3}), ("radial", {}),
         ("norm_preserving", {}), ("retract", {"p": 1.0}), ("retract", {"p": 2.0}), ("retract", {"p": math.inf}),
         ("retract", {"p": 4.0, "alpha": 2.5})]
IDS = [f"{u}-{'-'.join(f'{k}{v}' for k, v in kw.items())}" for u, kw in RULES]


def inputs(n, d, dtype, gated, seed=0, zero_rows=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * 3
    x[list(zero_rows)] = 0.0  # x = 0: the sphere of radius 0
    y = torch.randn(n, d, generator=g)
    gate = torch.full((1,), 0.7, device=DEVICE, requires_grad=True) if gated else None
    return x.to(DEVICE, dtype).requires_grad_(), y.to(DEVICE, dtype).requires_grad_(), gate


def grads(out, wanted, weights):
    if not out.requires_grad:  # "zero": a constant
        return [torch.zeros_like(w) for w in wanted]
    got = torch.autograd.grad((out.double() * weights).sum(), wanted, allow_unused=True)
    return [torch.zeros_like(w) if g is None else g for g, w in zip(got, wanted, strict=True)]


@kernels
@pytest.mark.parametrize("rule, kw", RULES, ids=IDS)
@pytest.mark.parametrize("d", [123, 576, 1000])
def test_forward_and_backward_match_the_reference_and_fused_in_float32(rule, kw, d):
    """n = ROWS + 3 rows: two programs, the second partial; rows 1 and n - 1 have x = 0."""
    n = triton_update.rows_per_program(d) + 3
    assert n % triton_update.rows_per_program(d) != 0 and n > triton_update.rows_per_program(d)
    for gated, mode in ((False, "absolute"), (True, "relative")):
        x, y, gate = inputs(n, d, torch.float32, gated, zero_rows=(1, n - 1))
        args = dict(eps=1e-6, eps_mode=mode, gate=gate, **kw)
        ref = residual_delta(x.double(), y.double(), rule, **{**args, "gate": None if gate is None else gate.double()})
        out = triton_update.triton_residual_delta(x, y, rule, **args)
        assert out.dtype == torch.float32 and out.shape == x.shape
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        if rule == "retract":
            assert torch.equal(out[[1, n - 1]], torch.zeros(2, d, device=DEVICE))  # x = 0 stays 0
        weights = torch.randn_like(ref)
        wanted = [x, y] + ([gate] if gated else [])
        got = grads(out, wanted, weights)
        for name, expected in (("reference", grads(ref, wanted, weights)),
                               ("fused", grads(fused_residual_delta(x, y, rule, **args), wanted, weights))):
            for e, g in zip(expected, got, strict=True):
                torch.testing.assert_close(g.double(), e.double(), rtol=1e-4, atol=1e-4 * max(1.0, e.abs().max().item()),
                                           msg=lambda m, name=name: f"{name}: {m}")


@kernels
@pytest.mark.parametrize("rule, kw", RULES, ids=IDS)
def test_float64_gradcheck(rule, kw):
    x, y, gate = inputs(3, 7, torch.float64, True, seed=1)
    gate = gate.detach().double().requires_grad_()
    fn = lambda a, b, g: triton_update.triton_residual_delta(a, b, rule, eps=1e-6, gate=g, **kw)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, y, gate), atol=1e-5, rtol=1e-4)


@kernels
def test_bf16_boundary_and_zero_state():
    x, y, _ = inputs(4, 100, torch.bfloat16, False)
    ref = residual_delta(x.float(), y.float(), "projected")
    out = triton_update.triton_residual_delta(x, y, "projected")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.to(torch.bfloat16).float(), rtol=2e-2, atol=2e-1)
    zero = torch.zeros(2, 9, device=DEVICE)
    assert torch.equal(triton_update.triton_residual_delta(zero, torch.ones(2, 9, device=DEVICE), "retract", p=2.0),
                       torch.zeros(2, 9, device=DEVICE))


@kernels
def test_cached_launch_follows_every_call_argument():
    """One launcher per (d, dtypes, rule, flags, alignment): the row count, alpha (an int too), eps, p and
    a misaligned view change between calls that share it, and each call is still its own rule."""
    buffer = torch.randn(40 * 96 + 1, generator=torch.Generator().manual_seed(3)).to(DEVICE) * 3
    y_all = torch.randn(40, 96, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    gate32, gate16 = torch.tensor([0.7], device=DEVICE), torch.tensor([0.7], device=DEVICE, dtype=torch.bfloat16)
    calls = [(40, 0, {"alpha": 1}), (3, 0, {"alpha": 2, "eps": 1e-2}), (1, 1, {"alpha": 1.5}), (17, 1, {"p": 3.0}),
             (5, 0, {"gate": gate32}), (5, 0, {"gate": gate16})]
    with torch.no_grad():
        for n, offset, kw in calls:  # offset 1: x starts 4 bytes into its storage
            x, y = buffer[offset:offset + n * 96].view(n, 96), y_all[:n]
            out = triton_update.triton_residual_delta(x, y, "retract", **kw)
            torch.testing.assert_close(out, residual_delta(x, y, "retract", **kw), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"needs x and y of one shape, got \(2, 96\) and \(1, 96\)"):
        triton_update.triton_residual_delta(y_all[:2], y_all[:1], "retract")


def add_rms_norm_reference(x, y, weight, norm_eps, rule, offset, **kw):
    """The reference rule in float64 handed on in the model dtype, then vLLM's fused add + RMSNorm
    (vllm.ir.ops.fused_add_rms_norm: h = x + update, h * rsqrt(mean(h^2) + eps) * w), written out in float64."""
    delta = residual_delta(x.double(), y.double(), rule, **kw).to(x.dtype)
    h = x.double() + delta.double()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm_eps)
    return normed * (weight.double() + 1.0 if offset else weight.double()), h


@kernels
@pytest.mark.parametrize("rule, kw", RULES, ids=IDS)
@pytest.mark.parametrize("d", [123, 576])
def test_rule_add_rms_norm_kernel_matches_the_rule_then_vllms_add_norm_in_float32(rule, kw, d):
    """One pass: (RMSNorm(h), h) for h = x + update, against the reference rule and vLLM's add + norm written out;
    n = ROWS + 3 (a partial second program), rows with x = 0, Gemma's 1 + w, gates and both eps modes."""
    n = triton_update.rows_per_program(d) + 3
    weight = torch.randn(d, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    for gated, mode, offset in ((False, "absolute", False), (True, "relative", True)):
        x, y, gate = inputs(n, d, torch.float32, gated, zero_rows=(1, n - 1))
        x, y, gate = x.detach(), y.detach(), None if gate is None else gate.detach()
        args = dict(eps=1e-6, eps_mode=mode, gate=gate, **kw)
        out, h = triton_update.triton_add_rms_norm(x, y, weight, 1e-5, rule, weight_offset=offset, **args)
        ref_out, ref_h = add_rms_norm_reference(x, y, weight, 1e-5, rule, offset, **args)
        assert out.dtype == h.dtype == torch.float32 and out.shape == h.shape == x.shape
        torch.testing.assert_close(h.double(), ref_h, rtol=1e-5, atol=1e-5 * ref_h.abs().max().item())
        torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5 * ref_out.abs().max().item())


@kernels
def test_rule_add_rms_norm_kernel_in_bfloat16_and_its_refusals():
    """bf16 in and out (the update rounded to bf16 before the add, as the unfused layer hands it on; the product
    with a bf16 weight in bf16): within one bf16 rounding of the float64 computation. A cached launcher per weight
    offset; the residual bit for bit; mismatched dtypes are refused by name."""
    x, y, _ = inputs(9, 200, torch.bfloat16, False)
    x, y = x.detach(), y.detach()
    weight = torch.randn(200, generator=torch.Generator().manual_seed(6)).to(DEVICE, torch.bfloat16)
    for offset in (False, True, False):
        out, h = triton_update.triton_add_rms_norm(x, y, weight, 1e-6, "retract", p=2.0, weight_offset=offset)
        ref_out, ref_h = add_rms_norm_reference(x, y, weight, 1e-6, "retract", offset, p=2.0)
        assert out.dtype == h.dtype == torch.bfloat16
        # one bf16 rounding of the update and one of the sum; the norm's factor carries that, plus two roundings.
        # A full bf16 ulp per rounding: triton's interpreter casts float32 to bf16 by truncation (a GPU rounds to
        # nearest; bit-exactness against vLLM's own kernel is benchmarks/gpu_check.py's, on a GPU)
        ulp = 2.0 ** -7
        bound_h = ulp * (2 * (ref_h - x.double()).abs() + ref_h.abs()) + 1e-30
        assert ((h.double() - ref_h).abs() <= bound_h).all()
        scale = torch.rsqrt(ref_h.pow(2).mean(-1, keepdim=True) + 1e-6) * (weight.double() + (1.0 if offset else 0.0)).abs()
        assert ((out.double() - ref_out).abs() <= bound_h * scale + 3 * ulp * ref_out.abs() + 1e-30).all()
    for dtype in (torch.float32, torch.float16):  # casts that round to nearest here: the residual is, bit for bit,
        # the rule kernel's update in the model dtype added to x in float32 (as vLLM's add + norm does with it)
        xd, yd = x.to(dtype) * 4, y.to(dtype)
        hd = triton_update.triton_add_rms_norm(xd, yd, weight.to(dtype), 1e-6, "retract", p=2.0)[1]
        delta = triton_update.triton_residual_delta(xd, yd, "retract", p=2.0)
        assert torch.equal(hd, (xd.float() + delta.float()).to(dtype))
    with pytest.raises(ValueError, match=r"x and y of one shape and dtype .* got \(9, 200\) torch.float32, "
                                         r"\(9, 200\) torch.bfloat16"):
        triton_update.triton_add_rms_norm(x.float(), y, weight, 1e-6, "projected")
    with pytest.raises(ValueError, match="has no kernel for update 'gaussian'"):
        triton_update.triton_add_rms_norm(x, y, weight, 1e-6, "gaussian")


@kernels
def test_no_grad_launch_makes_three_python_calls():
    """After warm-up, a no-grad call runs triton_residual_delta, _forward and the cached launch: no
    torch.library dispatch (17 calls into hf_tangent and torch.library / torch._library before).
    The kernels' own frames (which the interpreter runs as Python) are not counted."""
    kernel_names = {v.fn.__name__ for v in vars(triton_update).values() if hasattr(getattr(v, "fn", None), "__code__")}
    assert {"_forward_kernel", "_rows"} <= kernel_names
    x, y = torch.randn(3, 64, device=DEVICE), torch.randn(3, 64, device=DEVICE)
    calls = []

    def profile(frame, event, arg):
        name, path = frame.f_code.co_name, frame.f_code.co_filename.replace("\\", "/")
        if event == "call" and name not in kernel_names and (
                "hf_tangent/" in path or "torch/library" in path or "torch/_library" in path):
            calls.append(name)

    with torch.no_grad():
        triton_update.triton_residual_delta(x, y, "projected")
        sys.setprofile(profile)
        try:
            triton_update.triton_residual_delta(x, y, "projected")
        finally:
            sys.setprofile(None)
    assert calls == ["triton_residual_delta", "_forward", "launch"]


@kernels
def test_patched_model_with_triton_equals_fused(ids):
    model = make_tiny("llama").to(DEVICE).train()
    out = {}
    for implementation in ("fused", "triton"):
        ht.patch(model, ht.TangentConfig(update="retract", retraction="cayley", gates=True, implementation=implementation))
        model.zero_grad()
        loss = model(ids.to(DEVICE), labels=ids.to(DEVICE)).loss
        loss.backward()
        out[implementation] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert out["triton"][0] == pytest.approx(out["fused"][0], rel=1e-5)
    for name, grad in out["fused"][1].items():
        torch.testing.assert_close(out["triton"][1][name], grad, rtol=1e-3, atol=1e-5 * max(1.0, grad.abs().max().item()))


class Recorder:
    """A torch.compile backend that keeps the targets of every captured node (nested graphs included,
    e.g. an autograd.Function's) and runs the graph as captured."""

    def __init__(self):
        self.targets = []

    def __call__(self, gm, example_inputs):
        for module in gm.modules():
            if isinstance(module, torch.fx.GraphModule):
                self.targets += [str(node.target) for node in module.graph.nodes if node.op in ("call_function", "call_method")]
        return gm.forward


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("rule, kw", [("projected", {}), ("retract", {"p": 2.0}), ("soft", {"beta": 0.3})])
def test_compiled_rule_is_plain_torch_ops_equal_to_fused(rule, kw, grad, monkeypatch):
    """Under torch.compile the rule is fused_residual_delta's torch ops (inductor fuses them with the add
    next to it), never an hf_tangent:: custom op or a triton kernel; no GPU or interpreter needed: with
    the interpreter off, the eager call on these CPU tensors is refused, the compiled one runs."""
    import torch._dynamo

    monkeypatch.setattr(triton_update, "INTERPRET", False)

    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(2, 5, 48, generator=g) * 3, torch.randn(2, 5, 48, generator=g)
    gate = torch.tensor([0.8])
    if grad:
        x, y, gate = x.requires_grad_(), y.requires_grad_(), gate.requires_grad_()

    def step(x, y, gate, rule_fn):  # the layer's residual add around the rule
        return x + rule_fn(x, y, rule, eps_mode="relative", gate=gate, **kw)

    torch._dynamo.reset()
    recorder = Recorder()
    with torch.set_grad_enabled(grad):
        compiled = torch.compile(step, backend=recorder, fullgraph=True)(x, y, gate, triton_update.triton_residual_delta)
        expected = step(x, y, gate, fused_residual_delta)
    assert recorder.targets and not [t for t in recorder.targets if "hf_tangent" in t or "triton" in t], recorder.targets
    assert any("sum" in t for t in recorder.targets)  # the rule's reductions are in the graph, as torch ops
    assert torch.equal(compiled, expected)
    with pytest.raises(RuntimeError, match="implementation='triton' runs on CUDA tensors, got cpu; use implementation='fused'"):
        triton_update.triton_residual_delta(x, y, rule, **kw)
    if grad:
        weights = torch.randn(expected.shape, generator=g)
        got = torch.autograd.grad((compiled * weights).sum(), (x, y, gate))
        for e, c in zip(torch.autograd.grad((expected * weights).sum(), (x, y, gate)), got, strict=True):
            torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-6)


def test_inductor_compiles_the_patched_model_without_a_custom_op_or_graph_break(ids):
    import torch._dynamo

    model = ht.patch(make_tiny("llama").to(DEVICE), ht.TangentConfig(update="projected", implementation="triton"))
    reference = ht.patch(make_tiny("llama").to(DEVICE), ht.TangentConfig(update="projected", implementation="fused"))
    torch._dynamo.reset()
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(ids.to(DEVICE))
        assert explanation.graph_break_count == 0, explanation.break_reasons
        recorder = Recorder()
        torch.compile(model, fullgraph=True, backend=recorder)(ids.to(DEVICE))
        assert not [t for t in recorder.targets if "hf_tangent" in t or "triton" in t], recorder.targets
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="inductor")
        torch.testing.assert_close(compiled(ids.to(DEVICE)).logits, reference(ids.to(DEVICE)).logits, rtol=1e-4, atol=1e-4)


def test_triton_refuses_noise_updates_and_names_the_alternative():
    with pytest.raises(ValueError, match="TangentConfig.implementation='triton'.*'fused' or 'reference' for a noise update"):
        ht.TangentConfig(update="tangent_noise", implementation="triton")
    with pytest.raises(ValueError, match="implementation='triton' has no kernel for update 'tangent_noise'; accepted: add"):
        triton_update.triton_residual_delta(torch.ones(1, 4), torch.ones(1, 4), "tangent_noise")


@kernels
def test_hub_folder_of_a_triton_model_loads_without_hf_tangent(tmp_path, ids):
    from conftest import logits_without_hf_tangent

    model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected", implementation="triton"))
    ht.save_hub_folder(model, tmp_path / "hub")
    with torch.no_grad():
        expected = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected"))(ids).logits
    assert torch.equal(logits_without_hf_tangent(tmp_path / "hub", ids, tmp_path), expected)


@kernels
def test_each_row_is_the_row_computed_alone():
    """Batch-invariant by construction: ROWS depends on d only, and a row's bits do not depend on the rows
    beside it nor on its place in a program (9 rows alone, then at rows 28..36 of 37, across two programs)."""
    d, g = 123, torch.Generator().manual_seed(2)
    assert triton_update.rows_per_program(d) == 32
    x, y = (torch.randn(37, d, generator=g) * 3).to(DEVICE), torch.randn(37, d, generator=g).to(DEVICE)
    for k, (rule, kw) in enumerate(RULES):
        gated = k % 2 == 1
        args = dict(kw, gate=torch.tensor([0.8], device=DEVICE) if gated else None, eps_mode="relative" if gated else "absolute")
        alone = torch.cat([triton_update.triton_residual_delta(x[i:i + 1], y[i:i + 1], rule, **args) for i in range(28, 37)])
        for rows in (slice(28, 30), slice(28, 37), slice(0, 37)):
            out = triton_update.triton_residual_delta(x[rows], y[rows], rule, **args)[-(rows.stop - 28):]
            assert torch.equal(out.view(torch.int32), alone[:rows.stop - 28].view(torch.int32)), (rule, kw, gated, rows)
