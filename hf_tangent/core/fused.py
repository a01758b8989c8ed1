"""Fused update rules: one `torch.autograd.Function` per rule family with an analytic backward.

The forward computes x_next - x in float32 (or wider) and returns it in y's dtype, like
`rules.residual_delta` (the reference these are tested against). It saves only x and y in the
model's dtype, plus the gate: no float32 copies, no intermediates. The backward recomputes the
few per-token scalars it needs. Notation as in rules.py: per token, z = gate * y,
p = <x, z>, q = ||x||^2 + eps, c = p / q, r = ||x||; G is the incoming gradient.

Batch-invariant on a CPU, forward and backward: each row's result is the same bits whatever rows share the
call (a decode step of one sequence or of 64, a prompt alone or in a batch). `as_rows` makes every input
contiguous (torch sums a strided last dimension in another order) and `dot` sums one long row the way it sums
each row of a batch; rules.py sums with the same helpers (tests/test_batch_invariance.py).
Shipped as a patched folder's remote code; rules.py is not (its copy runs implementation='reference' as this).
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


FLOAT32_TINY = torch.finfo(torch.float32).tiny


def resolve_eps(x: torch.Tensor, eps: float, mode: str = "absolute") -> torch.Tensor | float:
    """eps itself, or the relative form eps * ||x||^2 per token, (..., 1).

    Per token, so that one token (a NaN, a zero state) cannot change another token's update; the
    float32 floor keeps c = <x, y> / (||x||^2 + eps) = 0 (not 0/0) where x = 0.
    """
    if mode == "relative":
        return (eps * dot(x, x)).clamp_min(FLOAT32_TINY).detach()
    return eps


def retraction_angle(t: torch.Tensor, p: float) -> torch.Tensor:
    """theta_p(t) = p atan(t / p); p = inf is the exponential map theta = t."""
    return t if math.isinf(p) else p * torch.atan(t / p)


def _project_back(gv, x, z, c, q, beta):
    """Gradients (dz, dx) of w = z - beta c x with upstream gv, c = <x,z>/q, q = <x,x> + eps."""
    gx_dot = dot(gv, x)
    dz = gv - beta * gx_dot * x / q
    dx = -beta * (c * gv + gx_dot * (z / q - 2.0 * c * x / q))
    return dz, dx


def _safe(value, ok):
    return torch.where(ok, value, torch.ones_like(value))


def _forward(x, y, gate, update, alpha, beta, p, eps, eps_mode):
    """x_next - x in y's dtype, computed in float32 (float64 for float64 y): the fused forward.

    Per token, every rule is a x + b z (z = gate y) with scalars (..., 1) from <x, x>, <x, z> and, where the rule
    needs them, the norms of z and of y_tan = z - c x (a norm of y_tan, not dot products: those cancel where z is
    nearly parallel to x); then one addcmul. Inline, without helper calls: it runs in every patched layer at every
    step (tests/test_rule_ops.py pins its aten ops and Python calls).
    """
    if x.shape[-1] >= _SPLIT and x.numel() == x.shape[-1]:  # one long row: reduced as one of two (rules.dot)
        return _forward(x.expand(2, *x.shape), y.expand(2, *y.shape), gate, update, alpha, beta, p, eps, eps_mode)[0]
    if update == "zero":
        return torch.zeros_like(y, memory_format=torch.contiguous_format)
    dtype = torch.float64 if y.dtype == torch.float64 else torch.float32
    z = y.to(dtype).contiguous()  # contiguous rows: each one summed in one order (rules.as_rows)
    if gate is not None:
        z = z * gate.to(dtype)
    if update == "add":
        return (z * alpha if alpha != 1.0 else z).to(y.dtype)
    x = x.to(dtype).contiguous()
    xx = (x * x).sum(-1, keepdim=True)  # ||x||^2, (..., 1)
    if eps_mode == "relative":  # eps ||x||^2 per token, floored: c = 0 (not 0/0) where x = 0 (rules.resolve_eps)
        eps = (xx * eps).clamp_min(FLOAT32_TINY)
    c = (x * z).sum(-1, keepdim=True) / (xx + eps)  # <x, z> / (||x||^2 + eps)
    if update in ("projected", "soft"):
        return torch.addcmul(z * alpha if alpha != 1.0 else z, c, x,
                             value=-alpha * (beta if update == "soft" else 1.0)).to(y.dtype)
    if update == "radial":
        return (x * (c * alpha if alpha != 1.0 else c)).to(y.dtype)
    y_tan = torch.addcmul(z, c, x, value=-1.0)  # z - c x (math.md section 1)
    if update == "norm_preserving":
        nz = torch.linalg.vector_norm(z, dim=-1, keepdim=True)
        nt = torch.linalg.vector_norm(y_tan, dim=-1, keepdim=True)
        return (y_tan * ((nz * alpha if alpha != 1.0 else nz) / (nt + eps))).to(y.dtype)
    if update != "retract":
        raise ValueError(f"unknown update rule {update!r}")
    # rules.retract with v = alpha y_tan, t = ||v|| / ||x||, theta = p atan(t / p): x_next - x is
    # (cos(theta) - 1) x + (sin(theta) / t) v = b y_tan - k a x, with b = alpha sin(theta) / t and k a = 1 - cos(theta)
    # in a form that does not cancel for small theta; p = 1 and 2 (projection, Cayley) need no trigonometry.
    # Where x = 0 these are inf or NaN: masked below.
    nv = torch.linalg.vector_norm(y_tan, dim=-1, keepdim=True)
    if alpha != 1.0:
        nv = nv * abs(alpha)  # ||v||
    if p == 1.0:  # theta = atan(t): sin / t = cos = 1 / s, s = sqrt(1 + t^2); 1 - cos = t^2 / (s^2 + s)
        t2 = (nv * nv / xx).clamp_max(torch.finfo(dtype).max)  # t^2 overflows: the limit theta -> pi / 2, not inf / inf
        u = t2 + 1.0
        s = u.sqrt()
        b, a, k = s.reciprocal(), t2 / (u + s), 1.0
    elif p == 2.0:  # theta = 2 atan(t / 2): sin / t = 1 / (1 + t^2 / 4); 1 - cos = (t^2 / 2) sin / t
        t2 = (nv * nv / xx).clamp_max(torch.finfo(dtype).max)  # as for p = 1: the limit theta -> pi
        b = (t2 * 0.25 + 1.0).reciprocal()
        a, k = t2 * b, 0.5
    else:  # 1 - cos = 2 sin^2(theta / 2); t = 0 (no step) floored, so that sin(theta) / t -> 1
        t = (nv / xx.sqrt()).clamp_min(FLOAT32_TINY)
        theta = t if math.isinf(p) else torch.atan(t / p) * p
        b, a, k = theta.sin() / t, (theta * 0.5).sin(), 2.0
        a = a * a
    delta = torch.addcmul(y_tan * (b * alpha if alpha != 1.0 else b), a, x, value=-k)
    moving = xx > 0
    delta = torch.where(moving, delta, moving)  # x = 0 (or NaN) stays 0: the sphere of radius 0
    if y.dtype.is_floating_point and y.dtype.itemsize < 4:  # |x_next - x| can reach 2 ||x||: past y.dtype's range
        delta = delta.clamp(-torch.finfo(y.dtype).max, torch.finfo(y.dtype).max)  # (rules.finite_in)
    return delta.to(y.dtype)


class _TangentUpdate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, gate, update, alpha, beta, p, eps, eps_mode):
        delta = _forward(x, y, gate, update, alpha, beta, p, eps, eps_mode)
        ctx.save_for_backward(x, y, gate)
        ctx.params = (update, alpha, beta, p, eps, eps_mode)  # a relative eps is recomputed from x
        return delta

    @staticmethod
    def backward(ctx, grad):
        x, y, gate = ctx.saved_tensors
        update, alpha, beta, p, eps, eps_mode = ctx.params
        dtype = torch.promote_types(y.dtype, torch.float32)
        xf, yf, g = as_rows(x, dtype), as_rows(y, dtype), as_rows(grad, dtype)
        eps = resolve_eps(xf, eps, eps_mode)
        z = yf * gate.to(dtype) if gate is not None else yf
        dx = torch.zeros_like(xf)
        if update == "add":
            dz = alpha * g
        elif update == "zero":
            dz = torch.zeros_like(z)
        else:
            q = dot(xf, xf) + eps
            c = dot(xf, z) / q
            ga = alpha * g
            if update in ("projected", "soft"):
                dz, dx = _project_back(ga, xf, z, c, q, beta if update == "soft" else 1.0)
            elif update == "radial":  # c x = z - (z - c x): the projection's gradient, subtracted
                dz_tan, dx_tan = _project_back(ga, xf, z, c, q, 1.0)
                dz, dx = ga - dz_tan, -dx_tan
            elif update == "norm_preserving":
                t = z - c * xf
                nz, nt = z.norm(dim=-1, keepdim=True), t.norm(dim=-1, keepdim=True)
                k = nz / (nt + eps)
                gt_dot = dot(ga, t)
                grad_t = k * ga - gt_dot * nz / (nt + eps) ** 2 * t / _safe(nt, nt > 0)
                dz, dx = _project_back(grad_t, xf, z, c, q, 1.0)
                dz = dz + gt_dot / (nt + eps) * z / _safe(nz, nz > 0)
            elif update == "retract":
                v = alpha * (z - c * xf)
                r = xf.norm(dim=-1, keepdim=True)
                r2 = _safe(r, r > 0) ** 2
                t = v.norm(dim=-1, keepdim=True) / r2.sqrt()
                theta = retraction_angle(t, p)
                dtheta = torch.ones_like(t) if math.isinf(p) else 1.0 / (1.0 + (t / p) ** 2)
                small = t < 1e-4
                ts = _safe(t, ~small)
                sin_over_t = torch.where(small, torch.ones_like(t), torch.sin(theta) / ts)
                a = -2.0 * torch.sin(theta / 2) ** 2  # cos(theta) - 1
                b = sin_over_t
                # (da/dt)/t and (db/dt)/t, finite at t = 0 (series below 1e-4)
                series = -2.0 * ((0.0 if math.isinf(p) else 1.0 / (3.0 * p * p)) + 1.0 / 6.0)
                da_t = -dtheta * sin_over_t
                db_t = torch.where(small, torch.full_like(t, series),
                                   (dtheta * torch.cos(theta) * ts - torch.sin(theta)) / ts**3)
                g_x, g_v = dot(g, xf), dot(g, v)
                dl_dt_over_t = g_x * da_t + g_v * db_t
                dv = b * g + dl_dt_over_t * v / r2
                dx = a * g - dl_dt_over_t * (t * t) * xf / r2
                dz, dx_proj = _project_back(alpha * dv, xf, z, c, q, 1.0)
                still = r > 0  # where x = 0 the forward is the constant 0
                dz = torch.where(still, dz, torch.zeros_like(dz))
                dx = torch.where(still, dx + dx_proj, torch.zeros_like(dx))
            else:
                raise ValueError(f"unknown update rule {update!r}")
        dgate = None
        if gate is not None and ctx.needs_input_grad[2]:
            dgate = (dz * yf).sum().reshape(gate.shape).to(gate.dtype)
        dy = (dz * gate.to(dtype) if gate is not None else dz).to(y.dtype)
        return dx.to(x.dtype), dy, dgate, None, None, None, None, None, None


def fused_residual_delta(x, y, update, *, alpha=1.0, beta=1.0, p=1.0, eps=1e-6, eps_mode="absolute", gate=None):
    """Same contract as `rules.residual_delta`, through the fused autograd Function (or, when no
    gradient is needed, its forward arithmetic alone: no autograd bookkeeping while generating; the
    same arithmetic, so a checkpointed forward, run without gradient, and its recomputation, run with
    it, agree bit for bit)."""
    if not torch.is_grad_enabled() or not (x.requires_grad or y.requires_grad or (gate is not None and gate.requires_grad)):
        return _forward(x, y, gate, update, alpha, beta, p, eps, eps_mode)
    return _TangentUpdate.apply(x, y, gate, update, float(alpha), float(beta), float(p), float(eps), eps_mode)
