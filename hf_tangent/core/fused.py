"""Fused update rules: one `torch.autograd.Function` per rule family with an analytic backward.

The forward computes x_next - x in float32 (or wider) and returns it in y's dtype, like
`rules.residual_delta` (the reference these are tested against). It saves only x and y in the
model's dtype, plus the gate: no float32 copies, no intermediates. The backward recomputes the
few per-token scalars it needs. Notation as in rules.py: per token, z = gate * y,
p = <x, z>, q = ||x||^2 + eps, c = p / q, r = ||x||; G is the incoming gradient.

Batch-invariant on a CPU, forward and backward, as rules.py: contiguous float32 rows (`as_rows`) and
rules.dot, so each row's bits do not depend on the rows beside it.
"""

from __future__ import annotations

import math

import torch

from .rules import as_rows, finite_in, resolve_eps, retraction_angle
from .rules import dot as _dot


def _project_back(gv, x, z, c, q, beta):
    """Gradients (dz, dx) of w = z - beta c x with upstream gv, c = <x,z>/q, q = <x,x> + eps."""
    gx_dot = _dot(gv, x)
    dz = gv - beta * gx_dot * x / q
    dx = -beta * (c * gv + gx_dot * (z / q - 2.0 * c * x / q))
    return dz, dx


def _safe(value, ok):
    return torch.where(ok, value, torch.ones_like(value))


def _forward(x, y, gate, update, alpha, beta, p, eps, eps_mode):
    """(x_next - x in y's dtype, the eps actually used): the fused forward's arithmetic."""
    dtype = torch.promote_types(y.dtype, torch.float32)
    xf, yf = as_rows(x, dtype), as_rows(y, dtype)
    z = yf * gate.to(dtype) if gate is not None else yf
    eps_value = resolve_eps(xf, eps, eps_mode)
    if update == "add":
        delta = alpha * z if alpha != 1.0 else z
    elif update == "zero":
        delta = torch.zeros_like(z)
    else:  # addcmul: one pass for "z - b c x"; per-token scalars stay (..., 1)
        c = _dot(xf, z) / (_dot(xf, xf) + eps_value)
        if update in ("projected", "soft"):
            b = beta if update == "soft" else 1.0
            delta = torch.addcmul(alpha * z if alpha != 1.0 else z, c, xf, value=-alpha * b)
        elif update == "radial":
            delta = (alpha * c) * xf
        elif update == "norm_preserving":
            t = torch.addcmul(z, c, xf, value=-1.0)
            delta = t * (alpha * z.norm(dim=-1, keepdim=True) / (t.norm(dim=-1, keepdim=True) + eps_value))
        elif update == "retract":
            tangent = torch.addcmul(z, c, xf, value=-1.0)  # v / alpha
            r = xf.norm(dim=-1, keepdim=True)
            t = abs(alpha) * tangent.norm(dim=-1, keepdim=True) / _safe(r, r > 0)
            theta = retraction_angle(t, p)
            moving = t > 0
            b = torch.where(moving, torch.sin(theta) / _safe(t, moving), torch.ones_like(t))
            delta = torch.addcmul(-2.0 * torch.sin(theta / 2) ** 2 * xf, alpha * b, tangent)
            delta = finite_in(torch.where(r > 0, delta, torch.zeros_like(delta)), y.dtype)  # x = 0 stays 0
        else:
            raise ValueError(f"unknown update rule {update!r}")
    return delta.to(y.dtype), eps_value


class _TangentUpdate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, gate, update, alpha, beta, p, eps, eps_mode):
        delta, _ = _forward(x, y, gate, update, alpha, beta, p, eps, eps_mode)
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
            q = _dot(xf, xf) + eps
            c = _dot(xf, z) / q
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
                gt_dot = _dot(ga, t)
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
                g_x, g_v = _dot(g, xf), _dot(g, v)
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
        return _forward(x, y, gate, update, alpha, beta, p, eps, eps_mode)[0]
    return _TangentUpdate.apply(x, y, gate, update, float(alpha), float(beta), float(p), float(eps), eps_mode)
