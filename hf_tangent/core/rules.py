"""The update rules of docs/math.md sections 1-2, as pure tensor functions.

Shapes: `x` and `y` are (..., d): `x` the residual the FFN branch reads, `y` the FFN output.
Reductions run over the last dimension; per-token scalars keep it as size 1, (..., 1).
Callers pass float32 (or wider) tensors; `residual_delta` does the casting.

Batch-invariant on a CPU: each row's result is the same bits whatever rows share the call (a decode
step of one sequence or of 64, a prompt alone or in a batch). `as_rows` makes every input contiguous
(torch sums a strided last dimension in another order) and `dot` sums one long row the way it sums
each row of a batch (tests/test_batch_invariance.py).
"""

from __future__ import annotations

import math

import torch

# torch's internal GRAIN_SIZE: a CPU reduction to one value over at least this many elements is split
# across threads (a partial sum per thread), where each row of a batch is summed by one thread in one pass
_SPLIT = 32768


def as_rows(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype`, contiguous (no copy where it already is): every row is then reduced in one order."""
    return t.to(dtype).contiguous()


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """<a, b> per row, (..., 1), in an order that does not depend on the number of rows."""
    prod = a * b
    if prod.numel() == prod.shape[-1] >= _SPLIT:  # one long row: summed as one of two rows, as in a batch
        return prod.expand(2, *prod.shape).sum(-1, keepdim=True)[0]
    return prod.sum(-1, keepdim=True)


def _norm(a: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(a, dim=-1, keepdim=True)  # (..., 1)


FLOAT32_TINY = torch.finfo(torch.float32).tiny


def resolve_eps(x: torch.Tensor, eps: float, mode: str = "absolute") -> torch.Tensor | float:
    """eps itself, or the relative form eps * ||x||^2 per token, (..., 1).

    Per token, so that one token (a NaN, a zero state) cannot change another token's update; the
    float32 floor keeps c = <x, y> / (||x||^2 + eps) = 0 (not 0/0) where x = 0.
    """
    if mode == "relative":
        return (eps * dot(x, x)).clamp_min(FLOAT32_TINY).detach()
    return eps


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


def retraction_angle(t: torch.Tensor, p: float) -> torch.Tensor:
    """theta_p(t) = p atan(t / p); p = inf is the exponential map theta = t."""
    return t if math.isinf(p) else p * torch.atan(t / p)


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


def noise_delta(x: torch.Tensor, y: torch.Tensor, update: str, *, alpha: float = 1.0, gamma: float = 0.0,
                h: float = 0.1, rank: int = 4, training: bool = True, gate: torch.Tensor | None = None) -> torch.Tensor:
    """Training-time stochastic updates (math.md section 3), x_next - x in y's dtype.

    Deterministic part alpha * y (the model's own add). In training mode, with r = ||x||, u = x / r:
      tangent_noise:    + r (h p + gamma sqrt(h) q),  p = A u - u <u, A u>, q = z - u <u, z>,
                        A = U U^T + V V^T with U, V in R^(d x rank) ~ N(0, 1/d), drawn per call (shared by
                        all tokens), z ~ N(0, I) per token: drift and noise tangent to the sphere at u
      gaussian_noise:   + gamma sqrt(h) r sqrt((d-1)/d) z, isotropic: the same expected energy as q's
      residual_dropout: y dropped per coordinate at a per-token rate p_i with p_i / (1 - p_i) =
                        gamma^2 h r^2 (d-1) / ||y||^2: the same expected noise energy again
    The residual is not renormalised (the next layer's norm does that in a pre-norm transformer).
    In eval mode every one of them is exactly alpha * y: no noise at evaluation.
    """
    dtype = torch.promote_types(y.dtype, torch.float32)
    xf, yf = x.to(dtype), y.to(dtype)
    if gate is not None:
        yf = yf * gate.to(dtype)
    if not training or gamma == 0.0 and update != "tangent_noise":
        return (alpha * yf).to(y.dtype)
    d = xf.shape[-1]
    r = _norm(xf)  # (..., 1)
    u = xf / (r + 1e-12)
    energy = gamma * gamma * h * (d - 1)  # expected ||noise||^2 / r^2
    if update == "tangent_noise":
        U = torch.randn(d, rank, dtype=dtype, device=x.device) / math.sqrt(d)
        V = torch.randn(d, rank, dtype=dtype, device=x.device) / math.sqrt(d)
        au = (u @ U) @ U.T + (u @ V) @ V.T  # (..., d)
        p = au - u * dot(u, au)
        z = torch.randn_like(xf)
        q = z - u * dot(u, z)
        delta = alpha * yf + r * (h * p + gamma * math.sqrt(h) * q)
    elif update == "gaussian_noise":
        delta = alpha * yf + gamma * math.sqrt(h) * math.sqrt((d - 1) / d) * r * torch.randn_like(xf)
    elif update == "residual_dropout":
        k = energy * r * r / (dot(yf, yf) + 1e-12)
        keep = (1.0 / (1.0 + k)).clamp(min=0.1)  # 1 - p_i, capped at p = 0.9
        mask = torch.rand_like(yf) < keep
        delta = alpha * yf * mask / keep
    else:
        raise ValueError(f"unknown noise update {update!r}")
    return delta.to(y.dtype)
