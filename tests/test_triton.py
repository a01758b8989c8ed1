"""The Triton kernels (implementation="triton") against the reference rules: every rule, float32
and float64 (gradcheck), odd d and masked tails, gates, both eps modes, the patched model, and
torch.compile without graph breaks. Without a GPU they run in triton's interpreter (conftest sets
TRITON_INTERPRET=1)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_tiny

import hf_tangent as ht
from hf_tangent.core.rules import residual_delta

triton_update = pytest.importorskip("hf_tangent.core.triton_update")
if not triton_update.available():
    pytest.skip("triton is not installed", allow_module_level=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not triton_update.INTERPRET:
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)

RULES = [("add", {"alpha": 0.7}), ("zero", {}), ("projected", {}), ("soft", {"beta": 0.3}), ("radial", {}),
         ("norm_preserving", {}), ("retract", {"p": 1.0}), ("retract", {"p": 2.0}), ("retract", {"p": math.inf}),
         ("retract", {"p": 4.0, "alpha": 2.5})]
IDS = [f"{u}-{'-'.join(f'{k}{v}' for k, v in kw.items())}" for u, kw in RULES]


def inputs(n, d, dtype, gated, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, d, generator=g) * 3).to(DEVICE, dtype).requires_grad_()
    y = torch.randn(n, d, generator=g).to(DEVICE, dtype).requires_grad_()
    gate = torch.full((1,), 0.7, device=DEVICE, requires_grad=True) if gated else None
    return x, y, gate


@pytest.mark.parametrize("rule, kw", RULES, ids=IDS)
@pytest.mark.parametrize("d", [123, 576, 1000])
def test_forward_and_backward_match_the_reference_in_float32(rule, kw, d):
    for gated, mode in ((False, "absolute"), (True, "relative")):
        x, y, gate = inputs(5, d, torch.float32, gated)
        args = dict(eps=1e-6, eps_mode=mode, gate=gate, **kw)
        ref = residual_delta(x.double(), y.double(), rule, **{**args, "gate": None if gate is None else gate.double()})
        out = triton_update.triton_residual_delta(x, y, rule, **args)
        assert out.dtype == torch.float32 and out.shape == x.shape
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        weights = torch.randn_like(ref)
        wanted = [x, y] + ([gate] if gated else [])
        expected = (torch.autograd.grad((ref * weights).sum(), wanted, allow_unused=True) if ref.requires_grad
                    else [None] * len(wanted))  # "zero": a constant
        got = torch.autograd.grad((out.double() * weights).sum(), wanted, allow_unused=True)
        for e, g in zip(expected, got, strict=True):
            e = torch.zeros_like(g) if e is None else e
            torch.testing.assert_close(g.double(), e.double(), rtol=1e-4, atol=1e-4 * max(1.0, e.abs().max().item()))


@pytest.mark.parametrize("rule, kw", RULES, ids=IDS)
def test_float64_gradcheck(rule, kw):
    x, y, gate = inputs(3, 7, torch.float64, True, seed=1)
    gate = gate.detach().double().requires_grad_()
    fn = lambda a, b, g: triton_update.triton_residual_delta(a, b, rule, eps=1e-6, gate=g, **kw)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, y, gate), atol=1e-5, rtol=1e-4)


def test_bf16_boundary_and_zero_state():
    x, y, _ = inputs(4, 100, torch.bfloat16, False)
    ref = residual_delta(x.float(), y.float(), "projected")
    out = triton_update.triton_residual_delta(x, y, "projected")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.to(torch.bfloat16).float(), rtol=2e-2, atol=2e-1)
    zero = torch.zeros(2, 9, device=DEVICE)
    assert torch.equal(triton_update.triton_residual_delta(zero, torch.ones(2, 9, device=DEVICE), "retract", p=2.0),
                       torch.zeros(2, 9, device=DEVICE))


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


def test_compile_sees_one_op_and_no_graph_break(ids):
    import torch._dynamo

    model = ht.patch(make_tiny("llama").to(DEVICE), ht.TangentConfig(update="projected", implementation="triton"))
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(ids.to(DEVICE))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    # the interpreter cannot run under AOT tracing (fake tensors have no data): on CPU the captured
    # graph runs with the eager backend; on a GPU inductor compiles it, the Triton kernel included
    compiled = torch.compile(model, fullgraph=True, backend="eager" if DEVICE == "cpu" else "inductor")
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids.to(DEVICE)).logits, model(ids.to(DEVICE)).logits, rtol=1e-4, atol=1e-4)


def test_triton_refuses_noise_updates_and_names_the_alternative():
    with pytest.raises(ValueError, match="TangentConfig.implementation='triton'.*'fused' or 'reference' for a noise update"):
        ht.TangentConfig(update="tangent_noise", implementation="triton")


def test_hub_folder_of_a_triton_model_loads_without_hf_tangent(tmp_path, ids):
    from conftest import logits_without_hf_tangent

    model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected", implementation="triton"))
    ht.save_hub_folder(model, tmp_path / "hub")
    with torch.no_grad():
        expected = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected"))(ids).logits
    assert torch.equal(logits_without_hf_tangent(tmp_path / "hub", ids, tmp_path), expected)


def test_each_row_is_the_row_computed_alone():
    """One program per row: batch-invariant by construction (tests/test_batch_invariance.py for the tensor ops)."""
    g = torch.Generator().manual_seed(2)
    x, y = (torch.randn(9, 123, generator=g) * 3).to(DEVICE), torch.randn(9, 123, generator=g).to(DEVICE)
    for k, (rule, kw) in enumerate(RULES):
        gated = k % 2 == 1
        args = dict(kw, gate=torch.tensor([0.8], device=DEVICE) if gated else None, eps_mode="relative" if gated else "absolute")
        alone = torch.cat([triton_update.triton_residual_delta(x[i:i + 1], y[i:i + 1], rule, **args) for i in range(9)])
        for n in (2, 9):
            out = triton_update.triton_residual_delta(x[:n], y[:n], rule, **args)
            assert torch.equal(out.view(torch.int32), alone[:n].view(torch.int32)), (rule, kw, gated, n)
