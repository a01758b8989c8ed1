"""What one call of the fused rule costs, pinned (issue 58): the aten ops and Python calls of a no-grad call on a
decode step's row, and the values of its few-op forms against the reference rules (rules.residual_delta) on the rows
where such forms could go wrong: x = 0, y = 0, y parallel to x, tiny and large steps, NaN, float16's range."""

import math
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_tangent.core.fused import fused_residual_delta
from hf_tangent.core.rules import residual_delta

pytestmark = pytest.mark.core

GATE = torch.nn.Parameter(torch.tensor([0.8]))  # as TangentLayer's gate
# name -> (update, kwargs, aten ops of one call on a (1, 1, 576) row in float32, in bfloat16: two casts in, one out
# and, for retract, the clamp to bfloat16's range). Before issue 58: retract 35 / 39 ops (p = 1), projected 8 / 11.
CASES = {
    "add": ("add", {"alpha": 0.5}, 1, 3),
    "zero": ("zero", {}, 1, 1),
    "projected": ("projected", {}, 7, 10),  # <x,x>, <x,z>: mul + sum each; + eps; c; one addcmul
    "projected, relative eps": ("projected", {"eps_mode": "relative"}, 9, 12),
    "soft": ("soft", {"beta": 0.3}, 7, 10),
    "radial": ("radial", {}, 7, 10),
    "norm_preserving": ("norm_preserving", {}, 12, 15),
    "retract": ("retract", {}, 20, 24),  # p = 1
    "retract, cayley": ("retract", {"p": 2.0}, 19, 23),
    "retract, exp": ("retract", {"p": math.inf}, 20, 24),
    "retract, p=0.7": ("retract", {"p": 0.7}, 23, 27),
    "retract, alpha": ("retract", {"alpha": 0.5}, 22, 26),
    "retract, gated": ("retract", {"gate": GATE}, 21, 25),
}


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", CASES)
def test_aten_ops_of_one_call(name, dtype):
    update, kw, f32, bf16 = CASES[name]
    x, y = torch.randn(1, 1, 576).to(dtype), torch.randn(1, 1, 576).to(dtype)
    with torch.no_grad(), _Ops() as counted:
        fused_residual_delta(x, y, update, **kw)
    assert len(counted.ops) == (f32 if dtype == torch.float32 else bf16), counted.ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", CASES)
def test_two_python_calls_per_call(name, dtype):
    """The rule is inline: no helper calls (before issue 58: 16 for retract, 7 for projected)."""
    update, kw, _, _ = CASES[name]
    x, y = torch.randn(1, 1, 576).to(dtype), torch.randn(1, 1, 576).to(dtype)
    calls = []

    def profile(frame, event, arg):
        if event == "call":
            calls.append(frame.f_code.co_name)

    with torch.no_grad():
        fused_residual_delta(x, y, update, **kw)  # warm-up
        previous = sys.getprofile()
        sys.setprofile(profile)
        try:
            fused_residual_delta(x, y, update, **kw)
        finally:
            sys.setprofile(previous)
    assert calls == ["fused_residual_delta", "_forward"]


def _rows(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 576, generator=g, dtype=torch.float64) * 3
    y = torch.randn(9, 576, generator=g, dtype=torch.float64)
    x[1] = 0  # a zero state
    y[2] = 0  # no update
    y[3] = -0.7 * x[3]  # parallel to x: a tangent step of rounding noise
    y[4] *= 1e-7  # a tiny step: the small-angle forms
    y[5] *= 50  # a large step: theta near its limit
    y[6, 3] = math.nan  # NaN in one row
    x[7], y[7, 0] = 0, math.nan  # a zero state with NaN in y: retract keeps it 0, as the reference does
    return x.to(dtype), y.to(dtype)


RULES = [("add", {}), ("zero", {}), ("projected", {}), ("soft", {"beta": 0.3}), ("radial", {}), ("norm_preserving", {})] + [
    ("retract", {"p": p}) for p in (1.0, 2.0, math.inf, 0.7)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("update, kw", RULES, ids=[f"{u}-{kw}" for u, kw in RULES])
def test_values_as_the_reference(update, kw, dtype):
    """Equal up to rounding: within 4 units of the arithmetic's last place of the row's scale ||x||_inf + ||alpha z||_inf
    (what x_next is rounded to), plus one unit of y's dtype where that is narrower; NaN exactly where the reference's."""
    x, y = _rows(dtype)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    for gate, eps_mode, alpha in ((None, "absolute", 1.0), (GATE, "relative", 2.5), (None, "relative", -0.5)):
        args = dict(kw, gate=gate, eps_mode=eps_mode, alpha=alpha)
        with torch.no_grad():
            out, ref = fused_residual_delta(x, y, update, **args), residual_delta(x, y, update, **args)
        assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
        assert torch.equal(out.isnan(), ref.isnan()), f"{args}: NaN in other places than the reference's"
        z = y.double() * (0.8 if gate is not None else 1.0)
        scale = x.double().abs().amax(-1, keepdim=True) + abs(alpha) * z.nan_to_num().abs().amax(-1, keepdim=True)
        ulp = 0.0 if dtype == compute else ref.double().nan_to_num().abs() * torch.finfo(dtype).eps + torch.finfo(dtype).tiny
        bound = 4 * torch.finfo(compute).eps * scale + ulp
        err = (out.double() - ref.double()).nan_to_num().abs()
        if update == "norm_preserving":  # parallel row: the direction is the rounding noise of z - c x, scaled to ||z||
            err[3] = 0
        assert (err <= bound).all(), f"{args}: rows {(err > bound).any(-1).nonzero().flatten().tolist()}"
        if update == "retract":
            assert (out[[1, 7]] == 0).all(), "x = 0 stays 0"
            assert not out[[0, 2, 3, 4, 5, 8]].isnan().any()


@pytest.mark.parametrize("p", [1.0, 2.0, math.inf, 0.7])
def test_retract_in_float16_is_clamped_as_the_reference(p):
    """Huge float16 states and steps: x_next - x reaches 2 ||x||, past float16's range; clamped to it as the
    reference clamps (rules.finite_in), so that x + delta stays finite."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, generator=g) * 1000
    x[:, 0] = 40000.0
    y = torch.randn(4, 64, generator=g) * 16000
    x, y = x.half(), y.half()
    with torch.no_grad():
        out, ref = fused_residual_delta(x, y, "retract", p=p), residual_delta(x, y, "retract", p=p)
    limit = torch.finfo(torch.float16).max
    assert torch.isfinite(x + out).all()
    clamped = ref.abs() == limit
    if p == math.inf:  # theta near pi: x_next near -x, delta near -2 x
        assert clamped.any()
    assert torch.equal(out[clamped], ref[clamped])
    assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2**-10 + 2**-14).all()


@pytest.mark.parametrize("p", [1.0, 2.0, math.inf, 0.7])
def test_retract_of_a_state_whose_squared_norm_overflows(p):
    """||x||^2 past float32's range (a row of 1e30): t = ||v|| / ||x|| = 0, so x_next - x = v, as in the reference."""
    x, y = torch.full((2, 48), 1e30), torch.randn(2, 48, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = fused_residual_delta(x, y, "retract", p=p)
    assert torch.equal(out, y) and torch.equal(out, residual_delta(x, y, "retract", p=p))


@pytest.mark.parametrize("p", [1.0, 2.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_retract_where_the_step_squared_overflows_is_the_limit_angle(p, dtype):
    """t^2 = ||v||^2 / ||x||^2 past float32's range: the closed forms of p = 1 and 2 gave inf / inf = NaN (fresh-eyes
    review); the reference's angle saturates (p = 1: theta = pi / 2, p = 2: theta = pi)."""
    x = torch.cat([torch.full((1, 64), 3e-20), torch.ones(1, 64)]).to(dtype)
    y = torch.cat([torch.randn(1, 64, generator=torch.Generator().manual_seed(0)), torch.full((1, 64), 1e19)]).to(dtype)
    out, ref = fused_residual_delta(x, y, "retract", p=p), residual_delta(x, y, "retract", p=p)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2 * x.float().norm(dim=-1).max().item())
