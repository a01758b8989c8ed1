"""The fused update (analytic backward) against float64 gradcheck and the reference rules."""

import math

import pytest
import torch
from conftest import ARCHS, make_tiny

import hf_tangent as ht
from hf_tangent.core.fused import fused_residual_delta
from hf_tangent.core.rules import residual_delta

pytestmark = pytest.mark.core

RULES = [
    ("add", {}), ("zero", {}), ("projected", {}), ("soft", {"beta": 0.3}), ("radial", {}), ("norm_preserving", {}),
    ("retract", {"p": 1.0}), ("retract", {"p": 2.0}), ("retract", {"p": math.inf}), ("retract", {"p": 0.7, "alpha": 2.5}),
    ("projected", {"eps_mode": "relative", "alpha": 0.5}),
]
IDS = [f"{u}-{kw}" for u, kw in RULES]


@pytest.mark.parametrize("update, kwargs", RULES, ids=IDS)
@pytest.mark.parametrize("scale", [1.0, 1e-6])  # 1e-6: tiny tangent steps, the small-angle branch
def test_analytic_backward_passes_gradcheck(update, kwargs, scale):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 4, 6, generator=g, dtype=torch.float64) * 2).requires_grad_()
    y = (torch.randn(3, 4, 6, generator=g, dtype=torch.float64) * scale).requires_grad_()
    gate = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, y, gate: fused_residual_delta(x, y, update, gate=gate, **kwargs),
                                    (x, y, gate), eps=1e-6 * scale, atol=1e-6, rtol=1e-4)


def _grads(fn, x, y, gate, upstream):
    out = fn()
    if not out.requires_grad:
        return out, (torch.zeros_like(x), torch.zeros_like(y), torch.zeros_like(gate))
    return out, torch.autograd.grad(out, (x, y, gate), upstream, allow_unused=True)


@pytest.mark.parametrize("update, kwargs", RULES, ids=IDS)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, None)])
def test_fused_matches_reference(update, kwargs, dtype, tol):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(4, 9, 64, generator=g) * 20).to(dtype).requires_grad_()
    y = torch.randn(4, 9, 64, generator=g).to(dtype).requires_grad_()
    gate = torch.tensor(0.9, requires_grad=True)
    upstream = torch.randn(4, 9, 64, generator=g).to(dtype)
    ref, ref_grads = _grads(lambda: residual_delta(x, y, update, gate=gate, **kwargs), x, y, gate, upstream)
    out, grads = _grads(lambda: fused_residual_delta(x, y, update, gate=gate, **kwargs), x, y, gate, upstream)
    assert out.dtype == ref.dtype == dtype
    for a, b in zip((ref, *ref_grads), (out, *grads), strict=True):
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        if tol is not None:
            torch.testing.assert_close(b.float(), a.float(), rtol=tol, atol=tol * max(1.0, a.abs().max().item()))
        else:  # bf16: the same float32 math rounded once; differences of one bf16 ulp at most
            ulp = a.float().abs() * 2**-7 + 1e-30
            assert ((b.float() - a.float()).abs() <= ulp * 1.01 + 1e-6 * a.float().abs().max()).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_and_reference_models_agree(arch, ids):
    results = {}
    for implementation in ("fused", "reference"):
        model = make_tiny(arch, **({"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0} if arch == "gpt2" else {}))
        ht.patch(model, ht.TangentConfig(update="retract", retraction="cayley", gates=True, implementation=implementation))
        model.train()
        loss = model(ids, labels=ids).loss
        loss.backward()
        results[implementation] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (loss_f, grads_f), (loss_r, grads_r) = results["fused"], results["reference"]
    assert loss_f == pytest.approx(loss_r, rel=1e-6)
    for name, grad in grads_r.items():
        torch.testing.assert_close(grads_f[name], grad, rtol=1e-5, atol=1e-6 * max(1.0, grad.abs().max().item()), msg=name)


def test_fused_saves_only_x_and_y_in_model_dtype():
    """What autograd keeps for backward: the fused rule saves x and y (bf16) and the gate; the
    reference keeps float32 copies and intermediates."""
    x = torch.randn(8, 128, 256, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randn(8, 128, 256, dtype=torch.bfloat16, requires_grad=True)

    def saved_bytes(fn):
        total = []

        def pack(t):
            total.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sum(total)

    fused = saved_bytes(lambda: fused_residual_delta(x, y, "norm_preserving"))
    reference = saved_bytes(lambda: residual_delta(x, y, "norm_preserving"))
    assert fused == 2 * x.numel() * 2  # x and y, bf16
    assert reference > 4 * fused
