"""Update rules against closed forms written out independently here (math.md sections 1-2)."""

import math

import pytest
import torch

from hf_tangent.core import rules

pytestmark = pytest.mark.core


@pytest.fixture
def xy():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, 16, generator=g, dtype=torch.float64) * 3  # (B, T, d)
    y = torch.randn(5, 7, 16, generator=g, dtype=torch.float64)
    return x, y


def tangent(x, y):
    u = x / x.norm(dim=-1, keepdim=True)
    return y - (u * y).sum(-1, keepdim=True) * u


def test_projection_removes_radial_component(xy):
    x, y = xy
    y_tan = rules.soft_projection(x, y, 1.0, eps=1e-6)
    cosine = rules.dot(x, y_tan).abs() / (x.norm(dim=-1, keepdim=True) * y_tan.norm(dim=-1, keepdim=True))
    assert cosine.max() < 1e-7
    torch.testing.assert_close(y_tan, tangent(x, y), rtol=1e-6, atol=1e-6)


def test_soft_interpolates_between_add_and_projection(xy):
    x, y = xy
    assert torch.equal(rules.soft_projection(x, y, 0.0, eps=1e-6), y)
    half = rules.soft_projection(x, y, 0.5, eps=1e-6)
    torch.testing.assert_close(half, 0.5 * (y + tangent(x, y)), rtol=1e-6, atol=1e-6)


def test_norm_preserving_keeps_norm_and_tangent_direction(xy):
    x, y = xy
    y_np = rules.norm_preserving_projection(x, y, eps=1e-9)
    torch.testing.assert_close(y_np.norm(dim=-1), y.norm(dim=-1), rtol=1e-7, atol=0)
    torch.testing.assert_close(torch.nn.functional.cosine_similarity(y_np, tangent(x, y), dim=-1),
                               torch.ones(5, 7, dtype=torch.float64))


def test_radial_plus_tangent_is_y(xy):
    x, y = xy
    torch.testing.assert_close(rules.radial_part(x, y, 0.0) + tangent(x, y), y)


@pytest.mark.parametrize("p", [0.5, 1.0, 2.0, 4.0, math.inf])
@pytest.mark.parametrize("scale", [1e-3, 0.3, 5.0])
def test_retraction_keeps_norm(xy, p, scale):
    x, y = xy
    v = tangent(x, y) * scale
    x_next = x + rules.retract(x, v, p)
    torch.testing.assert_close(x_next.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=0)


def test_retraction_p1_is_metric_projection(xy):
    x, y = xy
    v = tangent(x, y)
    r = x.norm(dim=-1, keepdim=True)
    expected = r * (x + v) / (x + v).norm(dim=-1, keepdim=True)
    torch.testing.assert_close(x + rules.retract(x, v, 1.0), expected)


def test_retraction_p2_is_cayley_transform(xy):
    x, y = xy
    x, v = x[0, 0], 2.5 * tangent(x, y)[0, 0]  # one token, (d,)
    r = x.norm()
    u, w, t = x / r, v / v.norm(), v.norm() / r
    omega = t * (torch.outer(w, u) - torch.outer(u, w))  # skew generator of the rotation u -> w
    eye = torch.eye(len(x), dtype=x.dtype)
    cayley = torch.linalg.solve(eye - omega / 2, eye + omega / 2)
    torch.testing.assert_close(x + rules.retract(x, v, 2.0), cayley @ x)


def test_retraction_pinf_is_exponential_map(xy):
    x, y = xy
    v = 1.7 * tangent(x, y)
    r = x.norm(dim=-1, keepdim=True)
    t = v.norm(dim=-1, keepdim=True) / r
    expected = torch.cos(t) * x + r * torch.sin(t) * v / v.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(x + rules.retract(x, v, math.inf), expected)


def test_retraction_p_to_zero_is_identity_and_p_large_approaches_exp(xy):
    x, y = xy
    v = tangent(x, y)
    assert (rules.retract(x, v, 1e-9)).norm(dim=-1).max() < 2e-9 * x.norm(dim=-1).max()  # |theta| <= p pi/2
    torch.testing.assert_close(rules.retract(x, v, 1e7), rules.retract(x, v, math.inf), rtol=1e-6, atol=1e-6)


def test_retraction_saturates_at_p_pi_over_2(xy):
    x, y = xy
    v = 1e6 * tangent(x, y)
    x_next = x + rules.retract(x, v, 1.0)
    cos = torch.nn.functional.cosine_similarity(x_next, x, dim=-1)
    torch.testing.assert_close(torch.arccos(cos.clamp(-1, 1)), torch.full_like(cos, math.pi / 2), atol=1e-5, rtol=0)


def test_zero_tangent_is_identity_with_finite_gradients():
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    y = (2.0 * x).detach().requires_grad_(True)  # purely radial: tangent part is zero
    delta = rules.residual_delta(x, y, "retract", p=2.0, eps=1e-300)
    assert delta.abs().max() < 1e-12
    delta.sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(y.grad).all()


def test_residual_delta_computes_in_float32_and_returns_input_dtype():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 32, generator=g) * 10).bfloat16()
    y = torch.randn(4, 32, generator=g).bfloat16()
    out = rules.residual_delta(x, y, "projected")
    assert out.dtype == torch.bfloat16
    reference = tangent(x.double(), y.double()).bfloat16()  # exact arithmetic, one final rounding
    assert torch.equal(out, reference)


def test_relative_eps_scales_with_residual_norm():
    x = torch.full((2, 4), 100.0)
    assert rules.resolve_eps(x, 1e-6, "relative") == pytest.approx(1e-6 * 4e4)
    assert rules.resolve_eps(x, 1e-6, "absolute") == 1e-6


def test_gate_and_alpha_scale_the_used_update(xy):
    x, y = xy
    gate = torch.tensor(0.25, dtype=torch.float64)
    out = rules.residual_delta(x, y, "projected", alpha=2.0, gate=gate)
    torch.testing.assert_close(out, 0.5 * tangent(x, y), rtol=1e-6, atol=1e-6)
