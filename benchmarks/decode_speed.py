"""transformers `generate` of patched SmolLM2-135M against the unpatched model, as ratios measured in one run.

    python benchmarks/decode_speed.py --output benchmarks/results/decode_cpu.json          # ~5 min, 2 quiet cores
    python benchmarks/decode_speed.py --clock cpu --threads 1 --batches 1 \
        --output benchmarks/results/decode_cpu_process_time.json                          # for a busy machine
    python benchmarks/decode_speed.py --calls --clock cpu --threads 1 --output benchmarks/results/rule_calls_cpu.json  # ~1 min

Per batch size (`--batches` prompts of 64 tokens from the held-out Austen text, greedy, `--new-tokens`
new tokens each): every round runs the unpatched model and each variant once, in a rotated order
(`analysis.timing.interleaved_ratios`); the ratio is unpatched time / variant time (tokens/s of the
variant over the unpatched model's), median over `--repeats` rounds, with its quartiles. Variants: the
`projected` and `retract` rules on every layer and the parallel conversion of 8 layers (hooks, and fused:
one shared norm and one GEMM for the five input projections), each rule as it runs by default
(`implementation="fused"`: tensor ops). `--calls`: microseconds per call of the rule alone on
decode-sized rows (what each patched layer adds to a decode step).

`--clock cpu` times each call by the process's CPU time (`time.process_time`) instead of the wall clock:
on a machine that other jobs share, a run's wall time is mostly how long it waited for a core, which
moves from round to round by more than the patch costs; with `--threads 1` the CPU time is the work
itself (the wall time it would take alone), still moved by what the neighbours do to caches and memory.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import hf_tangent as ht
from hf_tangent.analysis.timing import interleaved_ratios
from hf_tangent.core.fused import fused_residual_delta

PARALLEL_8 = [6, 7, 8, 9, 20, 21, 22, 23]  # the healing study's set (benchmarks/vllm_speed.py)
VARIANTS = {"projected": dict(update="projected"), "retract": dict(update="retract"),
            "parallel 8": dict(parallel_layers=PARALLEL_8),
            "parallel 8 fused": dict(parallel_layers=PARALLEL_8, parallel_execution="fused")}


def rule_calls(repeats: int, clock=time.perf_counter) -> dict:
    """Microseconds per call of the rule alone (no gradient, float32), on decode-sized rows of SmolLM2's width
    (576): median over `repeats` rounds of 2000 calls each, the rules interleaved within a round."""
    out = {}
    rules = ("projected", "retract", "norm_preserving")
    for rows in (1, 16, 32, 64):
        x, y = torch.randn(rows, 1, 576), torch.randn(rows, 1, 576)
        times = {update: [] for update in rules}
        for i in range(repeats):
            for update in rules if i % 2 == 0 else reversed(rules):
                for _ in range(200):
                    fused_residual_delta(x, y, update)
                start = clock()
                for _ in range(2000):
                    fused_residual_delta(x, y, update)
                times[update].append((clock() - start) / 2000 * 1e6)
        for update in rules:
            out[f"{update}, {rows} rows"] = statistics.median(times[update])
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--calls", action="store_true", help="only the rule's cost per call (rule_calls)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="wall clock or the process's CPU time")
    parser.add_argument("--threads", type=int, help="torch's threads (default: torch's own choice)")
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.calls:
        result = {"benchmark": "decode_speed --calls", "dtype": "float32", "width": 576, "torch": torch.__version__,
                  "threads": torch.get_num_threads(), "clock": args.clock, "repeats": args.repeats,
                  "us_per_call": rule_calls(args.repeats, clock)}
        print(json.dumps(result, indent=2))
        if args.output:
            Path(args.output).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        return result
    from hf_tangent.artifacts.models import load_model
    from hf_tangent.training.data import load_documents, pack_windows

    base, tokenizer = load_model("smollm2-135m")
    base.eval()
    models = {}
    for name, fields in VARIANTS.items():
        model, _ = load_model("smollm2-135m")
        models[name] = ht.patch(model, ht.TangentConfig(**fields)).eval()
    windows = pack_windows(tokenizer, load_documents(split="evaluation"), 64, max(args.batches))

    def run(model, prompt):
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                           pad_token_id=0)

    rows = {}
    started = time.perf_counter()
    for batch in args.batches:
        prompt = windows[:batch]
        candidates = {name: lambda m=model, p=prompt: run(m, p) for name, model in models.items()}
        timed = interleaved_ratios(lambda p=prompt: run(base, p), candidates, repeats=args.repeats, warmup=1, clock=clock)
        rows[f"batch {batch}"] = {
            name: {"tokens_per_s_ratio": 1.0 / t["ratio_median"], "q25": 1.0 / t["ratio_q75"], "q75": 1.0 / t["ratio_q25"],
                   "unpatched_tokens_per_s": batch * args.new_tokens / t["baseline_median_s"],
                   "tokens_per_s": batch * args.new_tokens / t["candidate_median_s"], "ratios": t["ratios"]}
            for name, t in timed.items()}
        print(json.dumps({f"batch {batch}": {k: round(v["tokens_per_s_ratio"], 4) for k, v in rows[f"batch {batch}"].items()}}),
              flush=True)
    result = {"benchmark": "decode_speed", "model": "smollm2-135m", "dtype": "float32", "torch": torch.__version__,
              "threads": torch.get_num_threads(), "python": platform.python_version(), "machine": platform.machine(),
              "clock": args.clock, "prompt_tokens": 64, "new_tokens": args.new_tokens, "repeats": args.repeats,
              "timed_s": round(time.perf_counter() - started), "rows": rows}
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
