"""The update rules as one C function for small CPU calls: a decode step's rows in one pass.

A decode step hands each layer one row per sequence. There the rule's ~10 tensor ops cost their
dispatch, not their arithmetic (about 50 us per layer for `projected`, 300 us for `retract` on one
row of 576, against about 4 us for one op), and that fixed cost is what a one-token step shows. This
module compiles the rules of fused.py (its notation) into one C function at first use, with the
system's C compiler, caches the shared library, and calls it through ctypes: one call per layer.

Used by `fused.fused_residual_delta` where it is exact to use and cheaper than the tensor ops: no
gradient, plain strided CPU tensors whose memory the C function may read (no subclass, no neg-bit
view, no zero tensor, storage large enough), no dispatch or function mode, no functorch or
forward-mode AD, not traced or compiled (there inductor fuses the tensor ops itself), at most ROWS
rows (16 to 64 by rule), float32/float64/bfloat16/float16. Per-row sums run in double and results are rounded once to
y's dtype; the tensor ops round each op in float32. So the two agree to float32 rounding
(tests/test_cpu_update.py), not bit for bit: a call of at most ROWS rows and a larger one (prefill)
can differ in the last bit (with or without gradient, the same call takes the same path: fused.py), and where ||x||^2
overflows float32 (|x| near 1e19) the tensor ops give NaN where the kernel gives the finite value.
Without a compiler, or with HF_TANGENT_CPU_KERNEL=0, every call takes the tensor ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# per rule, the most rows a call may have for the kernel: above that the tensor ops (multi-threaded, their
# dispatch amortised) are as fast or faster on 2 cores (benchmarks/decode_speed.py --calls at 1-64 rows of 576)
ROWS = {"add": 16, "zero": 16, "soft": 16, "projected": 16, "radial": 16, "norm_preserving": 32, "retract": 64}
RULES = {"add": 0, "zero": 1, "soft": 2, "projected": 2, "radial": 3, "norm_preserving": 4, "retract": 5}
DTYPES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}
# rules.finite_in: a retraction is clamped to the model dtype's range where that is narrower than float32's
LIMITS = {dtype: torch.finfo(dtype).max if torch.finfo(dtype).max < torch.finfo(torch.float32).max else math.inf
          for dtype in DTYPES}
ENV = "HF_TANGENT_CPU_KERNEL"  # "0": never use the kernel

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline double from_bf16(uint16_t h) { uint32_t b = (uint32_t)h << 16; float f; memcpy(&f, &b, 4); return f; }
static inline uint16_t to_bf16(double v) {  /* float32, then round to nearest even (torch's); NaN stays quiet NaN */
    float f = (float)v; uint32_t b; memcpy(&b, &f, 4);
    return (f != f) ? (uint16_t)((b >> 16) | 0x40) : (uint16_t)((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}
#define PLAIN(v) (v)
#define TO_F32(v) ((float)(v))
#define F16_IN(v) ((double)(v))
#define TO_F16(v) ((_Float16)(float)(v))

/* One function per dtype: per row, one pass loads x and z = g y into double rows and sums x.x, x.z, z.z
   (two partial sums each); one pass writes the rule's result (norm_preserving and retract first sum
   ||z - c x||^2). The rules are those of fused.py. */
#define ROWS_FN(NAME, T, LOAD, STORE)                                                                          \
static void rows_##NAME(const T *x, const T *y, T *out, int64_t n, int64_t d, double g, int rule, double alpha, \
                        double beta, double p, int p_inf, double eps, int relative, double limit, double *xb,    \
                        double *zb) {                                                                           \
    for (int64_t row = 0; row < n; row++) {                                                                     \
        const T *xr = x + row * d, *yr = y + row * d;                                                          \
        T *o = out + row * d;                                                                                   \
        double xx0 = 0, xx1 = 0, xz0 = 0, xz1 = 0, zz0 = 0, zz1 = 0;                                           \
        int64_t i = 0;                                                                                          \
        for (; i + 2 <= d; i += 2) {                                                                            \
            double a0 = LOAD(xr[i]), a1 = LOAD(xr[i + 1]), b0 = g * LOAD(yr[i]), b1 = g * LOAD(yr[i + 1]);    \
            xb[i] = a0; xb[i + 1] = a1; zb[i] = b0; zb[i + 1] = b1;                                            \
            xx0 += a0 * a0; xx1 += a1 * a1; xz0 += a0 * b0; xz1 += a1 * b1; zz0 += b0 * b0; zz1 += b1 * b1;   \
        }                                                                                                       \
        for (; i < d; i++) {                                                                                    \
            double a0 = LOAD(xr[i]), b0 = g * LOAD(yr[i]);                                                     \
            xb[i] = a0; zb[i] = b0; xx0 += a0 * a0; xz0 += a0 * b0; zz0 += b0 * b0;                            \
        }                                                                                                       \
        double xx = xx0 + xx1, xz = xz0 + xz1, zz = zz0 + zz1, e = eps;                                        \
        if (relative) { e = eps * xx; if (!(e >= 1.1754943508222875e-38) && e == e) e = 1.1754943508222875e-38; } \
        double c = xz / (xx + e);                                                                               \
        if (rule == 0) { for (i = 0; i < d; i++) o[i] = STORE(alpha * zb[i]); continue; }                      \
        if (rule == 1) { for (i = 0; i < d; i++) o[i] = STORE(0.0); continue; }                                \
        if (rule == 2) { for (i = 0; i < d; i++) o[i] = STORE(alpha * (zb[i] - beta * c * xb[i])); continue; } \
        if (rule == 3) { double k = alpha * c; for (i = 0; i < d; i++) o[i] = STORE(k * xb[i]); continue; }    \
        double tt0 = 0, tt1 = 0;  /* ||z - c x||^2, the tangent part */                                        \
        for (i = 0; i + 2 <= d; i += 2) {                                                                       \
            double t0 = zb[i] - c * xb[i], t1 = zb[i + 1] - c * xb[i + 1];                                     \
            tt0 += t0 * t0; tt1 += t1 * t1;                                                                     \
        }                                                                                                       \
        for (; i < d; i++) { double t0 = zb[i] - c * xb[i]; tt0 += t0 * t0; }                                  \
        double tt = tt0 + tt1, r = sqrt(xx);                                                                    \
        if (rule == 4) {                                                                                        \
            double k = alpha * sqrt(zz) / (sqrt(tt) + e);                                                       \
            for (i = 0; i < d; i++) o[i] = STORE((zb[i] - c * xb[i]) * k);                                     \
            continue;                                                                                           \
        }                                                                                                       \
        /* retract: -2 sin^2(theta/2) x + alpha (sin(theta) / t) (z - c x), t = |alpha| ||z - c x|| / r */     \
        double t = fabs(alpha) * sqrt(tt) / (r > 0 ? r : 1.0);                                                  \
        double theta = p_inf ? t : p * atan(t / p);                                                             \
        double s = sin(theta / 2), a = -2.0 * s * s, k = alpha * (t > 0 ? sin(theta) / t : 1.0);               \
        int moving = r > 0;  /* x = 0 stays 0 (and a NaN radius gives 0, as the tensor ops do) */              \
        for (i = 0; i < d; i++) {                                                                               \
            double v = moving ? a * xb[i] + k * (zb[i] - c * xb[i]) : 0.0;                                     \
            o[i] = STORE(v > limit ? limit : (v < -limit ? -limit : v));  /* finite in the model dtype */       \
        }                                                                                                       \
    }                                                                                                           \
}
ROWS_FN(f32, float, PLAIN, TO_F32)
ROWS_FN(f64, double, PLAIN, PLAIN)
ROWS_FN(bf16, uint16_t, from_bf16, to_bf16)
ROWS_FN(f16, _Float16, F16_IN, TO_F16)

/* x_next - x for n rows of d (x, y, out of one dtype: 0 float32, 1 float64, 2 bfloat16, 3 float16).
   Returns 0, or 1 where the work rows could not be allocated (nothing written). */
int hf_tangent_update(const void *x, const void *y, const void *gate, void *out, int64_t n, int64_t d,
                      int dtype, int gate_dtype, int rule, double alpha, double beta, double p, int p_inf,
                      double eps, int relative, double limit) {
    double g = 1.0;
    if (gate) {
        if (gate_dtype == 0) g = *(const float *)gate;
        else if (gate_dtype == 1) g = *(const double *)gate;
        else if (gate_dtype == 2) g = from_bf16(*(const uint16_t *)gate);
        else g = (double)*(const _Float16 *)gate;
    }
    if (dtype != 1) { g = (float)g; alpha = (float)alpha; beta = (float)beta; }  /* as the float32 tensor ops take them */
    double *xb = malloc(2 * (size_t)d * sizeof(double));
    if (!xb) return 1;
    double *zb = xb + d;
    if (dtype == 0) rows_f32(x, y, out, n, d, g, rule, alpha, beta, p, p_inf, eps, relative, limit, xb, zb);
    else if (dtype == 1) rows_f64(x, y, out, n, d, g, rule, alpha, beta, p, p_inf, eps, relative, limit, xb, zb);
    else if (dtype == 2) rows_bf16(x, y, out, n, d, g, rule, alpha, beta, p, p_inf, eps, relative, limit, xb, zb);
    else rows_f16(x, y, out, n, d, g, rule, alpha, beta, p, p_inf, eps, relative, limit, xb, zb);
    free(xb);
    return 0;
}
"""

_LOCK = threading.Lock()
_STATE: dict = {}  # "function": the loaded C function, or None once loading failed


def _cache_dir() -> Path:
    """hf_tangent's cache (as artifacts.checkpoints: $HF_TANGENT_CACHE, else $XDG_CACHE_HOME/hf_tangent, else
    ~/.cache/hf_tangent; the core imports nothing of the rest of the package), folder kernels/."""
    root = os.environ.get("HF_TANGENT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "hf_tangent")
    return Path(root) / "kernels"


def _build(compiler: list[str], flags: list[str], library: Path) -> None:
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent, prefix="hf_tangent_build_") as tmp:
        source, built = Path(tmp) / "update.c", Path(tmp) / "update.so"
        source.write_text(SOURCE, encoding="utf-8")
        run = subprocess.run([*compiler, *flags, "-o", str(built), str(source), "-lm"], capture_output=True, text=True,
                             timeout=300)
        if run.returncode != 0:
            raise RuntimeError(f"{shlex.join(compiler)} failed: {run.stderr.strip()[-500:]}")
        os.replace(built, library)  # atomic: processes compiling at once each write a whole file


def _compile():
    try:
        compiler = shlex.split(os.environ["CC"]) if os.environ.get("CC") else [shutil.which("cc") or shutil.which("gcc")]
    except ValueError as err:
        raise RuntimeError(f"$CC={os.environ['CC']!r} cannot be split into a command: {err}") from err
    if not compiler or compiler[0] is None:
        raise RuntimeError("no C compiler (cc, gcc or $CC) found")
    # after any flags in $CC: IEEE arithmetic (NaN and inf as the tensor ops give them) whatever those say
    flags = ["-O3", "-fno-fast-math", "-shared", "-fPIC", "-std=c11", "-fno-math-errno"]
    key = hashlib.sha256("\n".join([SOURCE, *compiler, *flags, platform.machine(), sys.platform]).encode()).hexdigest()[:16]
    library = _cache_dir() / f"hf_tangent_update_{key}.so"

    def load(path: str):
        function = ctypes.CDLL(path).hf_tangent_update
        function.restype = ctypes.c_int
        return function

    if not library.exists():
        _build(compiler, flags, library)
    try:
        fn = load(str(library))
    except (OSError, AttributeError):  # ours by name but does not load (truncated by a crash, or foreign): built again
        _build(compiler, flags, library)
        # another spelling of the path: the dynamic loader returns an object it loaded under the same name
        fn = load(os.path.join(str(library.parent), ".", library.name))
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 3 + [ctypes.c_double] * 3 + \
        [ctypes.c_int, ctypes.c_double, ctypes.c_int, ctypes.c_double]
    return fn


def check_setting() -> str:
    """HF_TANGENT_CPU_KERNEL's value ('1' when unset), refused by name unless '0' or '1' (also checked at patch
    time, so that a misspelt setting is reported on every device and size, not only by small CPU calls)."""
    setting = os.environ.get(ENV, "1")
    if setting not in ("0", "1"):
        raise ValueError(f"hf_tangent: {ENV}={setting!r} is not understood; accepted: '1' (use the CPU update "
                         "kernel where it applies, the default) or '0' (always the tensor ops).")
    return setting


def kernel():
    """The C function, compiled and loaded at first use; None where it cannot be (logged once) or where
    HF_TANGENT_CPU_KERNEL=0."""
    if "function" not in _STATE:
        with _LOCK:
            if "function" not in _STATE:
                if check_setting() == "0":
                    _STATE["function"] = None
                else:
                    try:
                        _STATE["function"] = _compile()
                    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
                        logger.warning("hf_tangent: the CPU update kernel is not available (%s); the update rules "
                                       "run as tensor ops (the same results, slower in decode).", err)
                        _STATE["function"] = None
    return _STATE["function"]


def _readable(t: torch.Tensor) -> bool:
    """A plain strided CPU tensor whose storage holds its elements (data_ptr reads what the tensor shows)."""
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        return False
    if t.device.type != "cpu" or t.layout != torch.strided or t.is_nested or t.is_neg() or t._is_zerotensor():
        return False
    storage = t.untyped_storage()
    return storage.data_ptr() != 0 and storage.nbytes() >= (t.storage_offset() + t.numel()) * t.element_size()


def applies(x: torch.Tensor, y: torch.Tensor, gate, update: str) -> bool:
    """Whether the C function computes exactly this call (see the module docstring)."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or torch.jit.is_scripting():
        return False  # first: nothing below is for a tracer to see
    if update not in RULES or type(x) is not torch.Tensor or type(y) is not torch.Tensor:
        return False
    if x.is_nested or y.is_nested or x.layout != torch.strided or y.layout != torch.strided:
        return False
    if x.dtype != y.dtype or y.dtype not in DTYPES or x.shape != y.shape or y.dim() == 0 or y.numel() == 0:
        return False
    if y.numel() > ROWS[update] * y.shape[-1]:
        return False
    if gate is not None and (gate.dtype not in DTYPES or gate.numel() != 1 or gate.dim() > 1 or not _readable(gate)):
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None or torch.autograd.forward_ad._current_level >= 0:
        return False  # vmap / grad / jvp, forward-mode AD: wrapped tensors
    if torch._C._len_torch_dispatch_stack() > 0 or torch._C._is_torch_function_mode_enabled():
        return False  # make_fx, FakeTensorMode, counters: they must see the tensor ops
    if not (_readable(x) and _readable(y)):
        return False
    return kernel() is not None


def cpu_residual_delta(x, y, update, *, alpha=1.0, beta=1.0, p=1.0, eps=1e-6, eps_mode="absolute", gate=None):
    """Same contract as `rules.residual_delta` (x_next - x in y's dtype) for calls `applies` accepts."""
    fn = kernel()
    x2, y2 = x.contiguous(), y.contiguous()
    out = torch.empty_like(y2)
    d = y2.shape[-1]
    if gate is not None:
        gate = gate.detach()
    status = fn(x2.data_ptr(), y2.data_ptr(), None if gate is None else gate.data_ptr(), out.data_ptr(),
                y2.numel() // d, d, DTYPES[y.dtype], DTYPES[gate.dtype] if gate is not None else 0, RULES[update],
                float(alpha), float(beta if update == "soft" else 1.0), 0.0 if math.isinf(p) else float(p),
                int(math.isinf(p)), float(eps), int(eps_mode == "relative"), LIMITS[y.dtype])
    if status != 0:
        raise MemoryError(f"hf_tangent: the CPU update kernel could not allocate its {2 * d} work values.")
    return out
