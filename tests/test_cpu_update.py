"""The C update kernel for small CPU calls (core/cpu_update.py): against the float64 rules, against the
tensor ops per dtype, its special values, where it must not be used, and its fallbacks."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_tiny

import hf_tangent as ht
from hf_tangent.core import cpu_update
from hf_tangent.core.fused import _forward, fused_residual_delta
from hf_tangent.core.rules import residual_delta

pytestmark = pytest.mark.core

if cpu_update.kernel() is None:  # the kernel is optional: without a C compiler the tensor ops run (tested below)
    pytest.skip("no C compiler here: the CPU update kernel is not built", allow_module_level=True)

RULES = [
    ("add", {"alpha": 0.7}), ("zero", {}), ("projected", {}), ("soft", {"beta": 0.3}), ("radial", {"alpha": 1.5}),
    ("norm_preserving", {}), ("retract", {"p": 1.0}), ("retract", {"p": math.inf}), ("retract", {"p": 0.7, "alpha": 2.5}),
    ("retract", {"alpha": -0.5}), ("projected", {"eps_mode": "relative", "alpha": 0.5}),
    ("norm_preserving", {"eps_mode": "relative"}), ("retract", {"eps_mode": "relative", "p": 2.0}),
]
IDS = [f"{u}-{kw}" for u, kw in RULES]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _inputs(dtype, rows=6, d=123, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 1, d, generator=g, dtype=torch.float64) * 3).to(dtype)
    y = torch.randn(rows, 1, d, generator=g, dtype=torch.float64).to(dtype)
    x[0] = 0  # a zero state: c = 0, and a retraction leaves it at 0
    return x, y


@pytest.mark.parametrize("update, kwargs", RULES, ids=IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gated", [False, True])
def test_kernel_matches_the_rules(update, kwargs, dtype, gated):
    x, y = _inputs(dtype)
    gate = torch.tensor([0.8]) if gated else None
    assert cpu_update.applies(x, y, gate, update)
    out = cpu_update.cpu_residual_delta(x, y, update, gate=gate, **kwargs)
    ops = residual_delta(x, y, update, gate=gate, **kwargs)
    exact = residual_delta(x.double(), y.double(), update, gate=None if gate is None else gate.double(), **kwargs)
    assert out.dtype == dtype and out.shape == y.shape
    if dtype in (torch.float32, torch.float64):
        # the kernel accumulates in double and rounds once: at least as close to the float64 rules as the ops
        scale = exact.abs().max().item()
        unit = torch.finfo(dtype).eps * scale
        assert (out.double() - exact).abs().max().item() <= max((ops.double() - exact).abs().max().item(), 8 * unit)
    else:  # both round the same (or a more exact) value once into the narrow dtype: one ulp apart at most
        ulp = ops.float().abs() * (2**-7 if dtype == torch.bfloat16 else 2**-10) + torch.finfo(dtype).tiny
        assert ((out.float() - ops.float()).abs() <= ulp * 1.01).all()
    if update in ("retract", "radial", "zero"):
        assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(ops[0], out[0])  # x = 0 stays 0


def test_one_bad_row_stays_in_its_row_and_values_follow_the_ops():
    x, y = _inputs(torch.float32)
    x[1, 0, 5] = float("nan")
    y[2, 0, 7] = float("inf")
    for update, kwargs in RULES:
        out = cpu_update.cpu_residual_delta(x, y, update, **kwargs)
        ops = residual_delta(x, y, update, **kwargs)
        assert torch.equal(out.isnan(), ops.isnan()), update
        assert torch.equal(out.isinf(), ops.isinf()), update
        finite = ops.isfinite()
        torch.testing.assert_close(out[finite], ops[finite], rtol=1e-5, atol=1e-5)


def test_a_narrow_dtype_retraction_is_clamped_to_its_range_as_the_ops_do():
    # |x_next - x| reaches 2 ||x||: past float16's 65504 for ||x|| ~ 60000
    x = torch.zeros(2, 4, dtype=torch.float16)
    x[:, 0] = 60000.0
    y = torch.zeros(2, 4, dtype=torch.float16)
    y[:, 1] = 30000.0
    out = cpu_update.cpu_residual_delta(x, y, "retract", alpha=8.0, p=math.inf)
    ops = residual_delta(x, y, "retract", alpha=8.0, p=math.inf)
    assert torch.isfinite(out).all() and torch.equal(out, ops)
    assert out.abs().max().item() == torch.finfo(torch.float16).max


CASES = ["grad", "rows", "subclass", "mixed dtypes", "broadcast", "int", "unknown rule", "gate of two values",
         "gate of more dims than y", "neg-bit view", "neg-bit gate", "freed storage", "short storage", "zero tensor",
         "sparse", "nested"]


@pytest.mark.parametrize("case", CASES)
def test_where_the_kernel_is_not_used(case):
    x, y = _inputs(torch.float32)
    gate, update = None, "projected"
    if case == "gate of more dims than y":
        x, y, gate = x[:, 0], y[:, 0], torch.ones(1, 1, 1)
    elif case == "neg-bit view":  # .contiguous() keeps the flag; data_ptr holds the un-negated values
        y = torch._neg_view(y)
    elif case == "neg-bit gate":
        gate = torch.tensor([0.5 + 0.5j]).conj().imag
    elif case == "freed storage":  # what FSDP does to a freed parameter
        y = y.clone()
        y.untyped_storage().resize_(0)
    elif case == "short storage":
        y = y.clone()
        y.untyped_storage().resize_(8)
    elif case == "zero tensor":
        y = torch._efficientzerotensor(y.shape)
    elif case == "sparse":
        x, y = x[:, 0].to_sparse(), y[:, 0].to_sparse()
    elif case == "nested":
        x, y = torch.nested.nested_tensor([x[0, 0], x[1, 0]]), torch.nested.nested_tensor([y[0, 0], y[1, 0]])
    if case == "grad":
        y.requires_grad_()
    elif case == "rows":
        x, y = _inputs(torch.float32, rows=cpu_update.ROWS[update] + 1)
    elif case == "subclass":
        y = torch.nn.Parameter(y)
    elif case == "mixed dtypes":
        x = x.double()
    elif case == "broadcast":
        x = x[:1]
    elif case == "int":
        x, y = x.int(), y.int()
    elif case == "unknown rule":
        update = "tangent_noise"
    elif case == "gate of two values":
        gate = torch.ones(2)
    if case != "grad":
        assert not cpu_update.applies(x, y, gate, update)
        if case in ("neg-bit view", "neg-bit gate", "gate of more dims than y", "zero tensor"):  # and the right answer
            out, ref = fused_residual_delta(x, y, update, gate=gate), residual_delta(x, y, update, gate=gate)
            assert out.shape == ref.shape
            torch.testing.assert_close(out, ref)
    else:
        out = fused_residual_delta(x, y, update)
        assert out.grad_fn is not None  # the autograd Function, not the kernel


def test_dispatch_and_function_modes_see_the_tensor_ops():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    x, y = _inputs(torch.float32)
    graph = make_fx(lambda a, b: fused_residual_delta(a, b, "projected"))(x, y)
    x2, y2 = _inputs(torch.float32, seed=3)
    torch.testing.assert_close(graph(x2, y2), residual_delta(x2, y2, "projected"))  # the traced ops, not an empty_like
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert fused_residual_delta(x, y, "projected").shape == y.shape  # was a write through a null pointer
    with Recorder() as recorder:  # a counter or tracker sees the arithmetic, not one empty_like
        fused_residual_delta(x, y, "projected")
    assert any(op.startswith("aten.addcmul") for op in recorder.ops), recorder.ops
    with torch.device("cpu"):  # a function mode
        assert not cpu_update.applies(x, y, None, "projected")


def test_compile_vmap_and_forward_ad_take_the_tensor_ops():
    x, y = _inputs(torch.float32)
    expected = residual_delta(x, y, "retract")
    compiled = torch.compile(lambda a, b: fused_residual_delta(a, b, "retract"), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, y), expected)
    batched = torch.func.vmap(lambda a, b: fused_residual_delta(a, b, "retract"))(x, y)
    torch.testing.assert_close(batched, expected)
    tangent = torch.randn_like(y)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(y, tangent)
        assert not cpu_update.applies(x, dual, None, "retract")
        _, jvp = torch.autograd.forward_ad.unpack_dual(fused_residual_delta(x, dual, "retract"))
    assert jvp is not None and torch.isfinite(jvp).all()


def test_a_patched_model_generates_the_same_with_and_without_the_kernel(monkeypatch, ids):
    model = make_tiny("llama")
    ht.patch(model, ht.TangentConfig(update="retract", gates=True))
    model.eval()
    calls = []
    original = cpu_update.cpu_residual_delta
    monkeypatch.setattr("hf_tangent.core.fused.cpu_residual_delta", lambda *a, **k: calls.append(1) or original(*a, **k))
    with torch.no_grad():
        with_kernel = model.generate(ids[:, :8], max_new_tokens=12, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True)
        assert calls, "the kernel was not used in decode"
        monkeypatch.setattr("hf_tangent.core.fused.cpu_kernel_applies", lambda *a: False)
        count = len(calls)
        without = model.generate(ids[:, :8], max_new_tokens=12, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
        assert len(calls) == count
    assert torch.equal(with_kernel.sequences, without.sequences)
    for a, b in zip(with_kernel.logits, without.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _fresh(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


PROBE = """
import torch
from hf_tangent.core import cpu_update
from hf_tangent.core.fused import fused_residual_delta, _forward
x, y = torch.randn(3, 64), torch.randn(3, 64)
out, ops = fused_residual_delta(x, y, "retract"), _forward(x, y, None, "retract", 1.0, 1.0, 1.0, 1e-6, "absolute")[0]
print("kernel", cpu_update.kernel() is not None, "close", torch.allclose(out, ops, rtol=1e-5, atol=1e-6))
"""


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """The kernel loaded afresh in this process (a cache folder of its own), as before afterwards."""
    saved = dict(cpu_update._STATE)
    monkeypatch.setenv("HF_TANGENT_CACHE", str(tmp_path / "cache"))
    cpu_update._STATE.clear()
    yield tmp_path / "cache" / "kernels"
    cpu_update._STATE.clear()
    cpu_update._STATE.update(saved)


def _probe():
    x, y = torch.randn(3, 64), torch.randn(3, 64)
    return fused_residual_delta(x, y, "retract"), _forward(x, y, None, "retract", 1.0, 1.0, 1.0, 1e-6, "absolute")[0]


def test_switched_off_or_without_a_compiler_the_tensor_ops_run(fresh_kernel, monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("HF_TANGENT_CPU_KERNEL", "0")
    out, ops = _probe()
    assert cpu_update.kernel() is None and torch.equal(out, ops)
    assert not fresh_kernel.exists()  # nothing compiled
    monkeypatch.setenv("HF_TANGENT_CPU_KERNEL", "1")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    cpu_update._STATE.clear()
    out, ops = _probe()
    assert cpu_update.kernel() is None and torch.equal(out, ops)
    assert "the CPU update kernel is not available" in caplog.text and "no-such-compiler" in caplog.text


def test_a_setting_it_does_not_know_is_refused_by_name(fresh_kernel, monkeypatch):
    for value in ("false", "", " 0", "2"):
        monkeypatch.setenv("HF_TANGENT_CPU_KERNEL", value)
        cpu_update._STATE.clear()
        message = f"HF_TANGENT_CPU_KERNEL={value!r} is not understood; accepted: '1'"
        with pytest.raises(ValueError, match=message):
            _probe()
        model = make_tiny("llama")  # at patch time too (whatever the device and size), the model left unpatched
        with pytest.raises(ValueError, match=message):
            ht.patch(model, ht.TangentConfig(update="projected"))
        assert not ht.tangent_layers(model)


def test_a_cached_library_that_does_not_load_is_built_again(tmp_path):
    # in fresh processes: a process that has the library loaded keeps it mapped
    first = _fresh(PROBE, HF_TANGENT_CACHE=str(tmp_path))
    assert first.returncode == 0 and "kernel True close True" in first.stdout, first.stderr
    (library,) = (tmp_path / "kernels").glob("*.so")
    library.write_bytes(library.read_bytes()[:100])  # truncated, as by a crash of another tool mid-write
    again = _fresh(PROBE, HF_TANGENT_CACHE=str(tmp_path))
    assert again.returncode == 0 and "kernel True close True" in again.stdout, again.stderr
    assert library.stat().st_size > 1000


def test_the_library_is_compiled_once_and_reused_by_a_fresh_process(tmp_path):
    first = _fresh(PROBE, HF_TANGENT_CACHE=str(tmp_path))
    assert first.returncode == 0 and "kernel True close True" in first.stdout, first.stderr
    (library,) = (tmp_path / "kernels").glob("*.so")
    stamp = library.stat().st_mtime_ns
    second = _fresh(PROBE, HF_TANGENT_CACHE=str(tmp_path))
    assert second.returncode == 0 and "kernel True close True" in second.stdout, second.stderr
    assert [p.name for p in Path(library.parent).iterdir()] == [library.name]  # no temporary folder left
    assert library.stat().st_mtime_ns == stamp
