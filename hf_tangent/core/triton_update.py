"""The update rules as Triton kernels: one program per token row, float32 (or float64) reductions,
the model dtype at the boundary, an analytic backward that recomputes from x and y (nothing else
saved). Registered with `torch.library` (`triton_op`, a fake implementation and autograd), so
`torch.compile(fullgraph=True)` sees one op and no graph break. `fused.py` is the reference.

Per row (notation of fused.py): z = gate * y, c = <x, z> / (||x||^2 + eps), r = ||x||.
Triton runs on CUDA tensors; with TRITON_INTERPRET=1 (set before importing triton) the same
kernels run on CPU tensors, which is how the tests check them without a GPU.
"""

from __future__ import annotations

import math
import os

import torch

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
except ImportError:  # the optional dependency: implementation="triton" then says how to get it
    triton = None

RULES = {"add": 0, "zero": 1, "soft": 2, "projected": 2, "radial": 3, "norm_preserving": 4, "retract": 5}
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def available() -> bool:
    return triton is not None


def check_device(x: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("hf_tangent: implementation='triton' needs the `triton` package (pip install triton).")
    if x.device.type != "cuda" and not INTERPRET:
        raise RuntimeError(f"hf_tangent: implementation='triton' runs on CUDA tensors, got {x.device.type}; use "
                           "implementation='fused' there (or TRITON_INTERPRET=1, set before importing triton, to test).")


if triton is not None:

    @triton.jit
    def _atan(u):
        """atan(u) for u >= 0 (Cephes atanf: range reduction + odd polynomial, ~1e-7)."""
        big = u > 2.414213562373095
        mid = (u > 0.4142135623730950) & (u <= 2.414213562373095)
        base = tl.where(big, 1.5707963267948966, tl.where(mid, 0.7853981633974483, 0.0))
        w = tl.where(big, -1.0 / tl.where(big, u, 1.0), tl.where(mid, (u - 1.0) / (u + 1.0), u))
        z = w * w
        poly = ((8.05374449538e-2 * z - 1.38776856032e-1) * z + 1.99777106478e-1) * z - 3.33329491539e-1
        return base + poly * z * w + w

    @triton.jit
    def _row(X, Y, GATE, row, stride_x, stride_y, D, eps, RELATIVE: tl.constexpr, HAS_GATE: tl.constexpr,
             BLOCK: tl.constexpr, ACC: tl.constexpr):
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(ACC)
        y = tl.load(Y + row * stride_y + cols, mask=mask, other=0.0).to(ACC)
        gate = tl.load(GATE).to(ACC) if HAS_GATE else 1.0
        z = y * gate
        xx = tl.sum(x * x, axis=0)
        e = tl.maximum(eps * xx, 1.1754943508222875e-38) if RELATIVE else eps
        q = xx + e
        c = tl.sum(x * z, axis=0) / q
        return cols, mask, x, y, z, gate, xx, e, q, c

    @triton.jit
    def _retract_angle(t, p, P_INF: tl.constexpr):
        if P_INF:
            return t
        return p * _atan(t / p)

    @triton.jit
    def _forward_kernel(X, Y, GATE, OUT, stride_x, stride_y, stride_o, D, alpha, beta, p, eps, limit,
                        RULE: tl.constexpr, RELATIVE: tl.constexpr, HAS_GATE: tl.constexpr, P_INF: tl.constexpr,
                        BLOCK: tl.constexpr, ACC: tl.constexpr):
        row = tl.program_id(0)
        cols, mask, x, y, z, gate, xx, e, q, c = _row(X, Y, GATE, row, stride_x, stride_y, D, eps, RELATIVE,
                                                      HAS_GATE, BLOCK, ACC)
        if RULE == 0:
            delta = alpha * z
        elif RULE == 1:
            delta = z * 0.0
        elif RULE == 2:
            delta = alpha * (z - beta * c * x)
        elif RULE == 3:
            delta = (alpha * c) * x
        elif RULE == 4:
            t = z - c * x
            nz = tl.sqrt(tl.sum(z * z, axis=0))
            nt = tl.sqrt(tl.sum(t * t, axis=0))
            delta = t * (alpha * nz / (nt + e))
        else:
            tangent = z - c * x
            r = tl.sqrt(xx)
            t = tl.abs(alpha) * tl.sqrt(tl.sum(tangent * tangent, axis=0)) / tl.where(r > 0, r, 1.0)
            theta = _retract_angle(t, p, P_INF)
            b = tl.where(t > 0, tl.sin(theta) / tl.where(t > 0, t, 1.0), 1.0)
            s = tl.sin(theta * 0.5)
            delta = -2.0 * s * s * x + (alpha * b) * tangent
            delta = tl.where(r > 0, delta, 0.0)  # x = 0 stays 0
            delta = tl.minimum(tl.maximum(delta, -limit), limit)  # finite in the model dtype
        tl.store(OUT + row * stride_o + cols, delta.to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _project_back(gv, x, z, c, q, beta):
        """(dz, dx) of w = z - beta c x with upstream gv (fused._project_back)."""
        gx = tl.sum(gv * x, axis=0)
        dz = gv - beta * gx * x / q
        dx = -beta * (c * gv + gx * (z / q - 2.0 * c * x / q))
        return dz, dx

    @triton.jit
    def _backward_kernel(G, X, Y, GATE, DX, DY, DGATE, stride_g, stride_x, stride_y, D, alpha, beta, p, eps,
                         RULE: tl.constexpr, RELATIVE: tl.constexpr, HAS_GATE: tl.constexpr, P_INF: tl.constexpr,
                         BLOCK: tl.constexpr, ACC: tl.constexpr):
        row = tl.program_id(0)
        cols, mask, x, y, z, gate, xx, e, q, c = _row(X, Y, GATE, row, stride_x, stride_y, D, eps, RELATIVE,
                                                      HAS_GATE, BLOCK, ACC)
        g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(ACC)
        dx = x * 0.0
        if RULE == 0:
            dz = alpha * g
        elif RULE == 1:
            dz = g * 0.0
        elif RULE == 2:
            dz, dx = _project_back(alpha * g, x, z, c, q, beta)
        elif RULE == 3:
            dz_t, dx_t = _project_back(alpha * g, x, z, c, q, 1.0)
            dz = alpha * g - dz_t
            dx = -dx_t
        elif RULE == 4:
            ga = alpha * g
            t = z - c * x
            nz = tl.sqrt(tl.sum(z * z, axis=0))
            nt = tl.sqrt(tl.sum(t * t, axis=0))
            k = nz / (nt + e)
            gt = tl.sum(ga * t, axis=0)
            grad_t = k * ga - gt * nz / ((nt + e) * (nt + e)) * t / tl.where(nt > 0, nt, 1.0)
            dz, dx = _project_back(grad_t, x, z, c, q, 1.0)
            dz = dz + gt / (nt + e) * z / tl.where(nz > 0, nz, 1.0)
        else:
            v = alpha * (z - c * x)
            r = tl.sqrt(xx)
            r2 = tl.where(r > 0, r, 1.0) * tl.where(r > 0, r, 1.0)
            t = tl.sqrt(tl.sum(v * v, axis=0)) / tl.sqrt(r2)
            theta = _retract_angle(t, p, P_INF)
            if P_INF:
                dtheta = 1.0
                series = -2.0 / 6.0
            else:
                dtheta = 1.0 / (1.0 + (t / p) * (t / p))
                series = -2.0 * (1.0 / (3.0 * p * p) + 1.0 / 6.0)
            small = t < 1e-4
            ts = tl.where(small, 1.0, t)
            sin_over_t = tl.where(small, 1.0, tl.sin(theta) / ts)
            s = tl.sin(theta * 0.5)
            a = -2.0 * s * s
            da_t = -dtheta * sin_over_t
            db_t = tl.where(small, series, (dtheta * tl.cos(theta) * ts - tl.sin(theta)) / (ts * ts * ts))
            dl = tl.sum(g * x, axis=0) * da_t + tl.sum(g * v, axis=0) * db_t
            dv = sin_over_t * g + dl * v / r2
            dx_direct = a * g - dl * (t * t) * x / r2
            dz, dx_proj = _project_back(alpha * dv, x, z, c, q, 1.0)
            dz = tl.where(r > 0, dz, 0.0)
            dx = tl.where(r > 0, dx_direct + dx_proj, 0.0)
        tl.store(DX + row * stride_x + cols, dx.to(DX.dtype.element_ty), mask=mask)
        tl.store(DY + row * stride_y + cols, (dz * gate).to(DY.dtype.element_ty), mask=mask)
        if HAS_GATE:
            tl.store(DGATE + row, tl.sum(dz * y, axis=0))

    def _meta(x: torch.Tensor, y: torch.Tensor, gate, rule: int, p: float, relative: bool) -> dict:
        acc = tl.float64 if torch.promote_types(y.dtype, torch.float32) == torch.float64 else tl.float32
        return dict(RULE=rule, RELATIVE=relative, HAS_GATE=gate is not None, P_INF=math.isinf(p),
                    BLOCK=triton.next_power_of_2(x.shape[-1]), ACC=acc)

    @triton_op("hf_tangent::tangent_update", mutates_args=())
    def tangent_update(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None, rule: int, alpha: float,
                       beta: float, p: float, eps: float, relative: bool) -> torch.Tensor:
        """x_next - x for rows x, y (n, d) in y's dtype; see the module docstring."""
        out = torch.empty_like(y)
        limit = torch.finfo(y.dtype).max
        dummy = gate if gate is not None else y
        wrap_triton(_forward_kernel)[(x.shape[0],)](
            x, y, dummy, out, x.stride(0), y.stride(0), out.stride(0), x.shape[1], alpha, beta,
            p if math.isfinite(p) else 0.0, eps, limit, **_meta(x, y, gate, rule, p, relative))
        return out

    @triton_op("hf_tangent::tangent_update_backward", mutates_args=())
    def tangent_update_backward(grad: torch.Tensor, x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None,
                                rule: int, alpha: float, beta: float, p: float, eps: float,
                                relative: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dx, dy = torch.empty_like(x), torch.empty_like(y)
        dgate_rows = torch.zeros(x.shape[0] if gate is not None else 0, dtype=torch.promote_types(y.dtype, torch.float32),
                                 device=x.device)
        dummy = gate if gate is not None else y
        wrap_triton(_backward_kernel)[(x.shape[0],)](
            grad, x, y, dummy, dx, dy, dgate_rows, grad.stride(0), x.stride(0), y.stride(0), x.shape[1], alpha, beta,
            p if math.isfinite(p) else 0.0, eps, **_meta(x, y, gate, rule, p, relative))
        return dx, dy, dgate_rows

    @tangent_update.register_fake
    def _(x, y, gate, rule, alpha, beta, p, eps, relative):
        return torch.empty_like(y)

    @tangent_update_backward.register_fake
    def _(grad, x, y, gate, rule, alpha, beta, p, eps, relative):
        rows = x.shape[0] if gate is not None else 0
        return torch.empty_like(x), torch.empty_like(y), y.new_empty(rows, dtype=torch.promote_types(y.dtype, torch.float32))

    def _setup_context(ctx, inputs, output):
        x, y, gate, *params = inputs
        ctx.save_for_backward(x, y, gate)
        ctx.params = params

    def _backward(ctx, grad):
        x, y, gate = ctx.saved_tensors
        dx, dy, dgate_rows = tangent_update_backward(grad.contiguous(), x, y, gate, *ctx.params)
        dgate = None if gate is None else dgate_rows.sum().reshape(gate.shape).to(gate.dtype)
        return dx, dy, dgate, None, None, None, None, None, None

    tangent_update.register_autograd(_backward, setup_context=_setup_context)


def triton_residual_delta(x, y, update, *, alpha=1.0, beta=1.0, p=1.0, eps=1e-6, eps_mode="absolute", gate=None):
    """Same contract as `rules.residual_delta` (x_next - x in y's dtype), through the Triton kernels."""
    if update not in RULES:
        raise ValueError(f"implementation='triton' has no kernel for update {update!r}; accepted: {', '.join(RULES)}.")
    check_device(y)
    shape = y.shape
    x2, y2 = x.reshape(-1, shape[-1]).contiguous(), y.reshape(-1, shape[-1]).contiguous()  # (n, d)
    delta = tangent_update(x2, y2, gate, RULES[update], float(alpha), float(beta if update == "soft" else 1.0),
                           float(p), float(eps), eps_mode == "relative")
    return delta.reshape(shape)
