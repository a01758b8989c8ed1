"""The update rules of docs/math.md sections 1-2, as pure tensor functions.

Shapes: `x` and `y` are (..., d): `x` the residual the FFN branch reads, `y` the FFN output.
Reductions run over the last dimension; per-token scalars keep it as size 1, (..., 1).
Callers pass float32 (or wider) tensors; `residual_delta` does the casting.

Batch-invariant on a CPU, with fused.py's row helpers (`as_rows`, `dot`). The reference
(implementation="reference", what the tests compare against) stays in the package: a patched folder's remote
code runs fused.py's form of the same rule; the noise rules of section 3 are noise.py's.
"""

from __future__ import annotations

import torch

from .fused import as_rows, dot, resolve_eps, retraction_angle


def _norm(a: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(a, dim=-1, keepdim=True)  # (..., 1)


def finite_in(delta: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """delta clamped to `dtype`'s finite range (NaN stays NaN). For a retraction, x + delta stays
    finite in the model dtype wherever x_next is: |x_next - x| can reach 2 ||x||, past fp16's range."""
    if not dtype.is_floating_point or torch.finfo(dtype).max >= torch.finfo(delta.dtype).max:
        return delta
    limit = torch.finfo(dtype).max
    return delta.clamp(-limit, limit)


def radial_coefficient(x: torch.Tensor, y: torch.Tensor, eps) -> torch.Tensor:
    """c = <x, y> / (||x||^2 + eps), (..., 1)."""
    return dot(x, y) / (dot(x, x) + eps)


def soft_projection(x: torch.Tensor, y: torch.Tensor, beta: float, eps) -> torch.Tensor:
    """y - beta c x; beta = 1 is the hard tangent projection y_tan."""
    return y - beta * radial_coefficient(x, y, eps) * x


def norm_preserving_projection(x: torch.Tensor, y: torch.Tensor, eps) -> torch.Tensor:
    """y_tan * ||y|| / (||y_tan|| + eps): the tangent direction with the FFN output's magnitude."""
    y_tan = soft_projection(x, y, 1.0, eps)
    return y_tan * (_norm(y) / (_norm(y_tan) + eps))


def radial_part(x: torch.Tensor, y: torch.Tensor, eps) -> torch.Tensor:
    """c x: the ablation that keeps only the radial component."""
    return radial_coefficient(x, y, eps) * x


def retract(x: torch.Tensor, v: torch.Tensor, p: float) -> torch.Tensor:
    """x_next - x for the sphere retraction along the tangent vector `v` (v orthogonal to x).

    x_next = r (cos(theta) u + sin(theta) w) with r = ||x||, t = ||v|| / r, w = v / ||v||.
    Written as -2 sin^2(theta/2) x + (sin(theta) / t) v, which stays accurate for small theta
    and is the identity where ||v|| = 0. Where x = 0 the sphere has radius 0: x stays 0.
    """
    r = _norm(x)
    v_norm = _norm(v)
    t = v_norm / torch.where(r > 0, r, torch.ones_like(r))
    theta = retraction_angle(t, p)
    moving = t > 0
    sin_over_t = torch.where(moving, torch.sin(theta) / torch.where(moving, t, torch.ones_like(t)), torch.ones_like(t))
    delta = -2.0 * torch.sin(theta / 2) ** 2 * x + sin_over_t * v
    return torch.where(r > 0, delta, torch.zeros_like(delta))


def used_update(x: torch.Tensor, y: torch.Tensor, update: str, *, beta: float = 1.0, eps=1e-6) -> torch.Tensor:
    """y_used of math.md section 1 (Euclidean rules); 'retract' uses the tangent part P_u y."""
    if update == "add":
        return y
    if update in ("projected", "retract"):
        return soft_projection(x, y, 1.0, eps)
    if update == "soft":
        return soft_projection(x, y, beta, eps)
    if update == "norm_preserving":
        return norm_preserving_projection(x, y, eps)
    if update == "radial":
        return radial_part(x, y, eps)
    if update == "zero":
        return torch.zeros_like(y)
    raise ValueError(f"unknown update rule {update!r}")


def residual_delta(
    x: torch.Tensor,
    y: torch.Tensor,
    update: str,
    *,
    alpha: float = 1.0,
    beta: float = 1.0,
    p: float = 1.0,
    eps: float = 1e-6,
    eps_mode: str = "absolute",
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """x_next - x for one FFN step, computed in float32 (or wider) and returned in y's dtype.

    The model's own `residual + out` then yields x_next; for the Euclidean rules this is
    exactly x + alpha * y_used, with no subtraction of x.
    """
    dtype = torch.promote_types(y.dtype, torch.float32)
    xf, yf = as_rows(x, dtype), as_rows(y, dtype)
    if gate is not None:
        yf = yf * gate.to(dtype)
    eps_value = resolve_eps(xf, eps, eps_mode)
    tangent_or_used = used_update(xf, yf, update, beta=beta, eps=eps_value)
    if update == "retract":
        delta = finite_in(retract(xf, alpha * tangent_or_used, p), y.dtype)
    else:
        delta = alpha * tangent_or_used if alpha != 1.0 else tangent_or_used
    return delta.to(y.dtype)
