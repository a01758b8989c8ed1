"""transformers `generate` of patched SmolLM2-135M against the unpatched model, in one run, with the
CPU update kernel (core/cpu_update.py) and with the tensor ops it replaces.

    python benchmarks/decode_speed.py --output benchmarks/results/decode_cpu.json           # ~17 min, 2 cores
    python benchmarks/decode_speed.py --calls --output benchmarks/results/rule_calls_cpu.json   # ~1 min

Per batch size (1 and 32 prompts of 64 tokens from the held-out Austen text, greedy, `--new-tokens`
new tokens each): every round runs the unpatched model and each variant once, in a rotated order
(`analysis.timing.interleaved_ratios`); the ratio is unpatched time / variant time (tokens/s of the
variant over the unpatched model's), median over `--repeats` rounds, with its quartiles. Variants: the
`projected` and `retract` rules on every layer and the parallel conversion of 8 layers, each with the
kernel (the default) and with the tensor ops (the kernel switched off for the calls of that run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
from pathlib import Path

import torch

import hf_tangent as ht
from hf_tangent.analysis.timing import interleaved_ratios
from hf_tangent.core import cpu_update, fused

PARALLEL_8 = [6, 7, 8, 9, 20, 21, 22, 23]  # the healing study's set (benchmarks/vllm_speed.py)
VARIANTS = {"projected": dict(update="projected"), "retract": dict(update="retract"),
            "parallel 8": dict(parallel_layers=PARALLEL_8)}


@contextlib.contextmanager
def tensor_ops():
    """The update rules as tensor ops for the calls inside (what ran before the kernel)."""
    saved = fused.cpu_kernel_applies
    fused.cpu_kernel_applies = lambda *args: False
    try:
        yield
    finally:
        fused.cpu_kernel_applies = saved


def rule_calls(repeats: int) -> dict:
    """Microseconds per call of the rule alone, on decode-sized rows of SmolLM2's width (576): the default
    (the kernel up to cpu_update.ROWS rows, the tensor ops above) against the tensor ops; rounds interleaved,
    median over rounds of 2000 calls each."""
    import statistics
    import time

    out = {"rows_limit": dict(cpu_update.ROWS)}
    for rows in (1, 16, 32, 64):
        x, y = torch.randn(rows, 1, 576), torch.randn(rows, 1, 576)
        for update in ("projected", "retract", "norm_preserving"):
            times = {"default": [], "tensor ops": []}
            for i in range(repeats):
                for name in (("default", "tensor ops") if i % 2 == 0 else ("tensor ops", "default")):
                    with contextlib.nullcontext() if name == "default" else tensor_ops():
                        for _ in range(200):
                            fused.fused_residual_delta(x, y, update)
                        start = time.perf_counter()
                        for _ in range(2000):
                            fused.fused_residual_delta(x, y, update)
                        times[name].append((time.perf_counter() - start) / 2000 * 1e6)
            out[f"{update}, {rows} rows"] = {k: statistics.median(v) for k, v in times.items()}
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--calls", action="store_true", help="only the rule's cost per call (rule_calls)")
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    if args.calls:
        result = {"benchmark": "decode_speed --calls", "dtype": "float32", "width": 576, "torch": torch.__version__,
                  "threads": torch.get_num_threads(), "repeats": args.repeats, "us_per_call": rule_calls(args.repeats)}
        print(json.dumps(result, indent=2))
        if args.output:
            Path(args.output).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        return result
    from hf_tangent.artifacts.models import load_model
    from hf_tangent.training.data import load_documents, pack_windows

    if cpu_update.kernel() is None:
        raise SystemExit("decode_speed: the CPU update kernel is not available here (no C compiler?)")
    base, tokenizer = load_model("smollm2-135m")
    base.eval()
    models = {}
    for name, fields in VARIANTS.items():
        model, _ = load_model("smollm2-135m")
        models[name] = ht.patch(model, ht.TangentConfig(**fields)).eval()
    windows = pack_windows(tokenizer, load_documents(split="evaluation"), 64, max(args.batches))

    def run(model, prompt, kernel=True):
        with torch.no_grad(), (contextlib.nullcontext() if kernel else tensor_ops()):
            model.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                           pad_token_id=0)

    rows = {}
    for batch in args.batches:
        prompt = windows[:batch]
        candidates = {}
        for name, model in models.items():
            candidates[f"{name}, kernel"] = lambda m=model, p=prompt: run(m, p)
            candidates[f"{name}, tensor ops"] = lambda m=model, p=prompt: run(m, p, kernel=False)
        timed = interleaved_ratios(lambda p=prompt: run(base, p), candidates, repeats=args.repeats, warmup=1)
        rows[f"batch {batch}"] = {
            name: {"tokens_per_s_ratio": 1.0 / t["ratio_median"], "q25": 1.0 / t["ratio_q75"], "q75": 1.0 / t["ratio_q25"],
                   "unpatched_tokens_per_s": batch * args.new_tokens / t["baseline_median_s"],
                   "tokens_per_s": batch * args.new_tokens / t["candidate_median_s"], "ratios": t["ratios"]}
            for name, t in timed.items()}
        print(json.dumps({f"batch {batch}": {k: round(v["tokens_per_s_ratio"], 4) for k, v in rows[f"batch {batch}"].items()}}),
              flush=True)
    result = {"benchmark": "decode_speed", "model": "smollm2-135m", "dtype": "float32", "torch": torch.__version__,
              "threads": torch.get_num_threads(), "python": platform.python_version(), "machine": platform.machine(),
              "prompt_tokens": 64, "new_tokens": args.new_tokens, "repeats": args.repeats, "rows": rows}
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
