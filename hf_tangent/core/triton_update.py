"""The update rules as Triton kernels: ROWS token rows per program, float32 (or float64) reductions,
the model dtype at the boundary, an analytic backward that recomputes from x and y (nothing else
saved). `fused.py` is the reference arithmetic.

Three paths, one contract (`rules.residual_delta`):
- under `torch.compile`: `fused_residual_delta`, plain torch ops that inductor fuses with the residual
  add and the next norm around them (an opaque kernel there costs a launch and a round trip through memory);
- eager without gradient (decode): the forward kernel through a launcher cached per (kernel, d, dtypes,
  rule, flags, alignment, device): no torch.library dispatch, no triton argument binding per call;
- eager with gradient: a `torch.autograd.Function` over the forward and backward kernels.

Per row (notation of fused.py): z = gate * y, c = <x, z> / (||x||^2 + eps), r = ||x||.
Triton runs on CUDA tensors; with TRITON_INTERPRET=1 (set before importing triton) the same
kernels run on CPU tensors, which is how the tests check them without a GPU.
"""

from __future__ import annotations

import math
import os

import torch

from .fused import fused_residual_delta

try:
    import triton
    import triton.language as tl
except ImportError:  # the optional dependency: implementation="triton" then says how to get it
    triton = None

RULES = {"add": 0, "zero": 1, "soft": 2, "projected": 2, "radial": 3, "norm_preserving": 4, "retract": 5}
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_LAUNCH: dict[tuple, object] = {}  # key of _forward / _backward -> launch(args), filled at first use


def available() -> bool:
    return triton is not None


def check_device(x: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("hf_tangent: implementation='triton' needs the `triton` package (pip install triton).")
    if x.device.type != "cuda" and not INTERPRET:
        raise RuntimeError(f"hf_tangent: implementation='triton' runs on CUDA tensors, got {x.device.type}; use "
                           "implementation='fused' there (or TRITON_INTERPRET=1, set before importing triton, to test).")


def rows_per_program(d: int) -> int:
    """ROWS: about 4096 elements per program, so narrow rows (d = 576: 4 rows) share one."""
    return max(1, 4096 // triton.next_power_of_2(d))


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
    def _rows(X, Y, GATE, n, eps, D: tl.constexpr, RELATIVE: tl.constexpr, HAS_GATE: tl.constexpr,
              ROWS: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr):
        """This program's rows of x, y as (ROWS, BLOCK) tiles in ACC; per-row scalars are (ROWS, 1)."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
        cols = tl.arange(0, BLOCK)[None, :]
        mask = (rows < n) & (cols < D)
        offs = rows.to(tl.int64) * D + cols  # rows are contiguous; int64: n * D may pass 2^31
        x = tl.load(X + offs, mask=mask, other=0.0).to(ACC)
        y = tl.load(Y + offs, mask=mask, other=0.0).to(ACC)
        gate = tl.load(GATE).to(ACC) if HAS_GATE else 1.0
        z = y * gate
        xx = tl.sum(x * x, axis=1, keep_dims=True)
        e = tl.maximum(eps * xx, 1.1754943508222875e-38) if RELATIVE else eps
        q = xx + e
        c = tl.sum(x * z, axis=1, keep_dims=True) / q
        return rows, offs, mask, x, y, z, gate, xx, e, q, c

    @triton.jit
    def _retract_angle(t, p, P_INF: tl.constexpr):
        if P_INF:
            return t
        return p * _atan(t / p)

    @triton.jit
    def _rule_delta(x, z, xx, e, c, alpha, beta, p, LIMIT: tl.constexpr, RULE: tl.constexpr, P_INF: tl.constexpr):
        """x_next - x of the rule, in ACC (fused.py's arithmetic)."""
        if RULE == 0:
            delta = alpha * z
        elif RULE == 1:
            delta = tl.zeros_like(z)
        elif RULE == 2:
            delta = alpha * (z - beta * c * x)
        elif RULE == 3:
            delta = (alpha * c) * x
        elif RULE == 4:
            t = z - c * x
            nz = tl.sqrt(tl.sum(z * z, axis=1, keep_dims=True))
            nt = tl.sqrt(tl.sum(t * t, axis=1, keep_dims=True))
            delta = t * (alpha * nz / (nt + e))
        else:
            tangent = z - c * x
            r = tl.sqrt(xx)
            t = tl.abs(alpha) * tl.sqrt(tl.sum(tangent * tangent, axis=1, keep_dims=True)) / tl.where(r > 0, r, 1.0)
            theta = _retract_angle(t, p, P_INF)
            b = tl.where(t > 0, tl.sin(theta) / tl.where(t > 0, t, 1.0), 1.0)
            s = tl.sin(theta * 0.5)
            delta = -2.0 * s * s * x + (alpha * b) * tangent
            delta = tl.where(r > 0, delta, 0.0)  # x = 0 stays 0
            delta = tl.minimum(tl.maximum(delta, -LIMIT), LIMIT)  # finite in the model dtype
        return delta

    @triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["GATE"])
    def _forward_kernel(X, Y, GATE, OUT, n, alpha, beta, p, eps, D: tl.constexpr, LIMIT: tl.constexpr,
                        RULE: tl.constexpr, RELATIVE: tl.constexpr, HAS_GATE: tl.constexpr, P_INF: tl.constexpr,
                        ROWS: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr):
        rows, offs, mask, x, y, z, gate, xx, e, q, c = _rows(X, Y, GATE, n, eps, D, RELATIVE, HAS_GATE, ROWS,
                                                             BLOCK, ACC)
        delta = _rule_delta(x, z, xx, e, c, alpha, beta, p, LIMIT, RULE, P_INF)
        tl.store(OUT + offs, delta.to(OUT.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["GATE"])
    def _add_rms_norm_kernel(X, Y, GATE, W, RESIDUAL, OUT, n, alpha, beta, p, eps, norm_eps, D: tl.constexpr,
                             LIMIT: tl.constexpr, RULE: tl.constexpr, RELATIVE: tl.constexpr, HAS_GATE: tl.constexpr,
                             P_INF: tl.constexpr, W_OFFSET: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                             ACC: tl.constexpr):
        """The rule, the residual add and the next RMSNorm in one pass over x and y: vLLM's fused add + RMSNorm
        (vllm.ir.ops.fused_add_rms_norm) fed with the rule's update in the model dtype, as the layer hands it on."""
        rows, offs, mask, x, y, z, gate, xx, e, q, c = _rows(X, Y, GATE, n, eps, D, RELATIVE, HAS_GATE, ROWS,
                                                             BLOCK, ACC)
        delta = _rule_delta(x, z, xx, e, c, alpha, beta, p, LIMIT, RULE, P_INF)
        h = x + delta.to(RESIDUAL.dtype.element_ty).to(ACC)
        tl.store(RESIDUAL + offs, h.to(RESIDUAL.dtype.element_ty), mask=mask)
        normed = h * tl.rsqrt(tl.sum(h * h, axis=1, keep_dims=True) / D + norm_eps)  # masked columns are 0
        cols = tl.arange(0, BLOCK)[None, :]
        w = tl.load(W + cols, mask=cols < D, other=0.0)
        if W_OFFSET:  # Gemma: (1 + w) in float32
            out = normed * (w.to(ACC) + 1.0)
        else:  # in the weight's dtype, as x.to(weight.dtype) * weight
            out = (normed.to(W.dtype.element_ty).to(ACC) * w.to(ACC)).to(W.dtype.element_ty)
        tl.store(OUT + offs, out.to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _project_back(gv, x, z, c, q, beta):
        """(dz, dx) of w = z - beta c x with upstream gv (fused._project_back)."""
        gx = tl.sum(gv * x, axis=1, keep_dims=True)
        dz = gv - beta * gx * x / q
        dx = -beta * (c * gv + gx * (z / q - 2.0 * c * x / q))
        return dz, dx

    @triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["GATE"])
    def _backward_kernel(G, X, Y, GATE, DX, DY, DGATE, n, alpha, beta, p, eps, D: tl.constexpr,
                         LIMIT: tl.constexpr, RULE: tl.constexpr, RELATIVE: tl.constexpr, HAS_GATE: tl.constexpr,
                         P_INF: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr):
        rows, offs, mask, x, y, z, gate, xx, e, q, c = _rows(X, Y, GATE, n, eps, D, RELATIVE, HAS_GATE, ROWS,
                                                             BLOCK, ACC)
        g = tl.load(G + offs, mask=mask, other=0.0).to(ACC)
        dx = tl.zeros_like(x)
        if RULE == 0:
            dz = alpha * g
        elif RULE == 1:
            dz = tl.zeros_like(g)
        elif RULE == 2:
            dz, dx = _project_back(alpha * g, x, z, c, q, beta)
        elif RULE == 3:
            dz_t, dx_t = _project_back(alpha * g, x, z, c, q, 1.0)
            dz = alpha * g - dz_t
            dx = -dx_t
        elif RULE == 4:
            ga = alpha * g
            t = z - c * x
            nz = tl.sqrt(tl.sum(z * z, axis=1, keep_dims=True))
            nt = tl.sqrt(tl.sum(t * t, axis=1, keep_dims=True))
            k = nz / (nt + e)
            gt = tl.sum(ga * t, axis=1, keep_dims=True)
            grad_t = k * ga - gt * nz / ((nt + e) * (nt + e)) * t / tl.where(nt > 0, nt, 1.0)
            dz, dx = _project_back(grad_t, x, z, c, q, 1.0)
            dz = dz + gt / (nt + e) * z / tl.where(nz > 0, nz, 1.0)
        else:
            v = alpha * (z - c * x)
            r = tl.sqrt(xx)
            r2 = tl.where(r > 0, r, 1.0) * tl.where(r > 0, r, 1.0)
            t = tl.sqrt(tl.sum(v * v, axis=1, keep_dims=True)) / tl.sqrt(r2)
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
            dl = tl.sum(g * x, axis=1, keep_dims=True) * da_t + tl.sum(g * v, axis=1, keep_dims=True) * db_t
            dv = sin_over_t * g + dl * v / r2
            dx_direct = a * g - dl * (t * t) * x / r2
            dz, dx_proj = _project_back(alpha * dv, x, z, c, q, 1.0)
            dz = tl.where(r > 0, dz, 0.0)
            dx = tl.where(r > 0, dx_direct + dx_proj, 0.0)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        tl.store(DY + offs, (dz * gate).to(DY.dtype.element_ty), mask=mask)
        if HAS_GATE:
            tl.store(DGATE + rows, tl.sum(dz * y, axis=1, keep_dims=True), mask=rows < n)


def _compile(key: tuple, args: tuple, **extra) -> None:
    """First use of `key`: launch through triton (compiling) and cache launch(args) for the next calls.

    key = (kernel, d, x dtype, y dtype, gate dtype or None, rule, relative, p = inf, x and y 16-byte aligned,
    [the gradient's alignment and dtype | the norm weight's dtype, alignment and offset,] device): what triton
    specializes on (n is not specialized, the floats never are, the other pointers are fresh), so the compiled kernel is right for every later call with the
    same key and triton's per-call argument binding, specialization and cache lookup can be skipped.
    """
    kernel, d, _, y_dtype, gate_dtype, rule, relative, p_inf, *_ = key
    rows, block = rows_per_program(d), triton.next_power_of_2(d)
    acc = tl.float64 if torch.promote_types(y_dtype, torch.float32) == torch.float64 else tl.float32
    meta = dict(D=d, LIMIT=torch.finfo(y_dtype).max, RULE=rule, RELATIVE=relative, HAS_GATE=gate_dtype is not None,
                P_INF=p_inf, **extra, ROWS=rows, BLOCK=block, ACC=acc)
    at = kernel.arg_names.index("n")
    options = dict(num_warps=max(4, min(16, rows * block // 1024)))
    compiled = kernel[(triton.cdiv(args[at], rows),)](*args, **meta, **options)
    launch = None
    if not INTERPRET:
        # triton's own launch with what it decided at the first call; which constexprs the launcher takes
        # changed across triton versions (none before 3.3, all after): its compiled signature says
        passed = [name for name in kernel.arg_names if name in compiled.src.signature]
        if passed[:len(args)] == kernel.arg_names[:len(args)]:
            consts = tuple(meta[name] for name in passed[len(args):])
            run, function, packed, stream = (compiled.run, compiled.function, compiled.packed_metadata,
                                             triton.runtime.driver.active.get_current_stream)
            device = key[-1]

            def launch(args):
                run((args[at] + rows - 1) // rows, 1, 1, stream(device), function, packed, None, None, None, *args,
                    *consts)
    if launch is None:  # the interpreter (or an unknown launcher): triton's ordinary launch every time
        def launch(args):
            kernel[(triton.cdiv(args[at], rows),)](*args, **meta, **options)
    _LAUNCH[key] = launch


def _forward(x, y, gate, rule, alpha, beta, p, eps, relative):
    """x_next - x for rows x, y (n, d) in y's dtype, no autograd: one cached launch."""
    out = torch.empty_like(y)
    args = (x, y, y if gate is None else gate, out, y.shape[0], alpha, beta, p, eps)
    key = (_forward_kernel, y.shape[1], x.dtype, y.dtype, None if gate is None else gate.dtype, rule, relative,
           math.isinf(p), x.data_ptr() % 16 == 0, y.data_ptr() % 16 == 0, y.get_device())
    launch = _LAUNCH.get(key)
    if launch is None:
        _compile(key, args)
    else:
        launch(args)
    return out


def _backward(g, x, y, gate, rule, alpha, beta, p, eps, relative):
    """(dx, dy, dgate) for the upstream gradient g of _forward's output, rows (n, d)."""
    dx, dy = torch.empty_like(x), torch.empty_like(y)
    dgate_rows = torch.empty(y.shape[0] if gate is not None else 0, dtype=torch.promote_types(y.dtype, torch.float32),
                             device=y.device)
    args = (g, x, y, y if gate is None else gate, dx, dy, dgate_rows, y.shape[0], alpha, beta, p, eps)
    key = (_backward_kernel, y.shape[1], x.dtype, y.dtype, None if gate is None else gate.dtype, rule, relative,
           math.isinf(p), x.data_ptr() % 16 == 0, y.data_ptr() % 16 == 0, g.data_ptr() % 16 == 0, g.dtype,
           y.get_device())
    launch = _LAUNCH.get(key)
    if launch is None:
        _compile(key, args)
    else:
        launch(args)
    return dx, dy, None if gate is None else dgate_rows.sum().reshape(gate.shape).to(gate.dtype)


class _Update(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, gate, *params):
        ctx.save_for_backward(x, y, gate)
        ctx.params = params
        return _forward(x, y, gate, *params)

    @staticmethod
    def backward(ctx, grad):
        x, y, gate = ctx.saved_tensors
        return *_backward(grad.contiguous(), x, y, gate, *ctx.params), None, None, None, None, None, None


def triton_residual_delta(x, y, update, *, alpha=1.0, beta=1.0, p=1.0, eps=1e-6, eps_mode="absolute", gate=None):
    """Same contract as `rules.residual_delta` (x_next - x in y's dtype); the three paths of the module docstring."""
    rule = RULES.get(update)
    if rule is None:
        raise ValueError(f"implementation='triton' has no kernel for update {update!r}; accepted: {', '.join(RULES)}.")
    if torch.compiler.is_compiling():
        return fused_residual_delta(x, y, update, alpha=alpha, beta=beta, p=p, eps=eps, eps_mode=eps_mode, gate=gate)
    if triton is None or (y.device.type != "cuda" and not INTERPRET):
        check_device(y)
    if x.shape != y.shape:  # the kernels read x's rows at y's offsets
        raise ValueError(f"implementation='triton' needs x and y of one shape, got {tuple(x.shape)} and {tuple(y.shape)}.")
    d = y.shape[-1]
    x2, y2 = x.reshape(-1, d).contiguous(), y.reshape(-1, d).contiguous()  # (n, d)
    # floats always: a Python int 1 would be specialized into the cached kernel as a constant
    params = (rule, float(alpha), float(beta) if update == "soft" else 1.0, float(p), float(eps), eps_mode == "relative")
    if torch.is_grad_enabled() and (x.requires_grad or y.requires_grad or (gate is not None and gate.requires_grad)):
        return _Update.apply(x2, y2, gate, *params).view(y.shape)
    return _forward(x2, y2, gate, *params).view(y.shape)


def triton_add_rms_norm(x, y, weight, norm_eps, update, *, alpha=1.0, beta=1.0, p=1.0, eps=1e-6, eps_mode="absolute",
                        gate=None, weight_offset=False):
    """(RMSNorm(h), h) for h = x + rules.residual_delta(x, y, ...), the update in the model dtype: vLLM's fused
    add + RMSNorm of the next norm (`weight_offset`: Gemma's 1 + w) with the rule in the same kernel, one read of
    x and y. No autograd (serving); rows (..., d) of one dtype, on CUDA (or in the interpreter)."""
    rule = RULES.get(update)
    if rule is None:
        raise ValueError(f"implementation='triton' has no kernel for update {update!r}; accepted: {', '.join(RULES)}.")
    check_device(y)
    if x.shape != y.shape or x.dtype != y.dtype or weight.shape != y.shape[-1:]:
        raise ValueError(f"the fused add + RMSNorm needs x and y of one shape and dtype and a weight of their width, "
                         f"got {tuple(x.shape)} {x.dtype}, {tuple(y.shape)} {y.dtype} and {tuple(weight.shape)}.")
    d = y.shape[-1]
    x2, y2, w = x.reshape(-1, d).contiguous(), y.reshape(-1, d).contiguous(), weight.contiguous()
    residual, out = torch.empty_like(y2), torch.empty_like(y2)
    args = (x2, y2, y2 if gate is None else gate, w, residual, out, y2.shape[0], float(alpha),
            float(beta) if update == "soft" else 1.0, float(p), float(eps), float(norm_eps))
    key = (_add_rms_norm_kernel, d, x.dtype, y.dtype, None if gate is None else gate.dtype, rule,
           eps_mode == "relative", math.isinf(p), x2.data_ptr() % 16 == 0, y2.data_ptr() % 16 == 0, w.dtype,
           w.data_ptr() % 16 == 0, bool(weight_offset), y.get_device())
    launch = _LAUNCH.get(key)
    if launch is None:
        _compile(key, args, W_OFFSET=bool(weight_offset))
    else:
        launch(args)
    return out.view(y.shape), residual.view(y.shape)
