"""Benchmarks are not timed tests: each runs at a tiny size and produces well-formed output."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def run(script, *args):
    result = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_patch_overhead_tiny_and_performance_page(tmp_path):
    out = tmp_path / "tiny.json"
    run("patch_overhead.py", "--tiny", "--rules", "projected", "retract_cayley", "--output", str(out))
    results = json.loads(out.read_text())
    suites = {(r["rule"], r["suite"]): r for r in results["rows"]}
    assert set(suites) == {(rule, s) for rule in ("projected", "retract_cayley")
                           for s in ("forward", "train", "memory", "generate", "compile")}
    for row in results["rows"]:
        if row["suite"] in ("forward", "train", "generate", "compile"):
            assert row["ratio_q25"] <= row["ratio_median"] <= row["ratio_q75"]
            assert row["baseline_median_s"] > 0 and row["candidate_median_s"] > 0
    memory = suites[("projected", "memory")]
    assert memory["saved_bytes_patched"] >= memory["saved_bytes_unpatched"] > 0
    assert memory["peak_bytes_patched"] > 0 and memory["peak_bytes_unpatched"] > 0
    assert suites[("projected", "compile")]["graph_breaks_added"] == 0
    page = tmp_path / "performance.md"
    run("make_performance_md.py", str(out), "--output", str(page))
    text = page.read_text()
    assert "### tiny" in text and "| projected |" in text and "| retract_cayley |" in text


def test_diagnostics_overhead_tiny(tmp_path):
    out = tmp_path / "diag.json"
    run("diagnostics_overhead.py", "--tiny", "--repeats", "2", "--output", str(out))
    result = json.loads(out.read_text())
    assert result["benchmark"] == "diagnostics_overhead" and result["ratio_median"] > 0


def test_parallel_speed_tiny(tmp_path):
    out = tmp_path / "speed.json"
    run("parallel_speed.py", "--tiny", "--output", str(out))
    result = json.loads(out.read_text())
    assert len(result["layers"]) == 2 and result["estimated_speedup"] >= 1.0
    assert result["measured_speedup_hooks"] > 0 and result["measured_speedup_fused"] > 0


def test_gpu_check_fails_fast_without_a_gpu():
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = subprocess.run([sys.executable, str(BENCH / "gpu_check.py")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "gpu_check: no CUDA device here" in result.stderr


@__import__("pytest").mark.slow
def test_gpu_check_runs_its_steps_at_toy_size_on_the_cpu(tmp_path):
    """Everything after the gpu tests, at toy sizes in triton's interpreter: the code paths work and
    the JSON renders (the numbers mean nothing on a CPU)."""
    import os

    result = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--cpu-smoke", "--output", str(tmp_path / "gpu")],
                            capture_output=True, text=True, timeout=900, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert {r["rule"] for r in report["kernel"]} == {"projected", "retract"} and set(report["generate"]) == {"dynamic", "static"}
    again = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--render", str(tmp_path / "gpu.json")],
                           capture_output=True, text=True, timeout=120)
    assert again.stdout.strip() == (tmp_path / "gpu.md").read_text().strip()
