"""Parallel-residual conversion: the estimated speedup next to the measured one, for a forward and for decoding.

    python benchmarks/parallel_speed.py --k 12                      # SmolLM2-135M, lowest-C_l 12 layers
    python benchmarks/parallel_speed.py --layers 6 7 8 9 20 21 22 23 --clock cpu --threads 1   # decode_speed's set
    python benchmarks/parallel_speed.py --tiny                      # seconds, for the test suite

Estimated (`analysis.parallel.estimated_speedup`): what fused execution saves, from the unconverted model's
module times: one RMS normalisation per converted layer and one GEMM call per input projection beyond one
per branch (nothing runs concurrently; the hook conversion runs the same work, estimate 1.0). Forward:
module times of the `--seq-len`-token forward; decode: of a 1-token forward (a decode step without its KV
context). Measured: the converted models (hooks, fused) against the unconverted one in the same rounds
(`analysis.timing.interleaved_ratios`, median per-round ratio over `--repeats` rounds): a forward of
`--seq-len` tokens without cache; greedy `generate` of `--new-tokens` tokens after a 64-token prompt (batch 1,
KV cache); and, finer (`--step-repeats` rounds, so that a busy neighbour moves the median less), one decode
step after that prompt (its cache cropped back after each step). speedup = unconverted time / converted time.

`--clock cpu` times by the process's CPU time (`time.process_time`): with `--threads 1` that is the work
itself, whatever the neighbours on a shared machine do to the wall clock.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import hf_tangent as ht
from hf_tangent.analysis import parallel
from hf_tangent.analysis.timing import interleaved_ratios

EXECUTIONS = ("hooks", "fused")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=12, help="layers converted, lowest C_l first")
    parser.add_argument("--layers", type=int, nargs="+", help="the layers to convert (instead of --k)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--step-repeats", type=int, default=201, help="rounds of single decode steps")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="wall clock or the process's CPU time")
    parser.add_argument("--threads", type=int, help="torch's threads (default: torch's own choice)")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.tiny:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                             num_attention_heads=4, num_key_value_heads=2)).eval()
        args.k, args.seq_len, args.repeats, args.step_repeats, args.new_tokens, name = 2, 32, 2, 3, 4, "tiny-llama"
    else:
        from hf_tangent.artifacts.models import load_model

        model, _ = load_model("smollm2-135m")
        name = "smollm2-135m"
    model.eval()
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq_len))
    prompt = ids[:, :64]
    if args.layers is None:
        scores = parallel.sensitivity(model, ids)["scores"]
        layers = parallel.schedule_layers(scores, args.k, "low_c")
    else:
        layers = sorted(args.layers)
    times = parallel.submodule_times(model, ids, repeats=3, clock=clock)
    step_times = parallel.submodule_times(model, ids[:, :1], repeats=9, clock=clock)
    converted = {execution: ht.patch(copy.deepcopy(model), ht.TangentConfig(parallel_layers=layers,
                                                                               parallel_execution=execution)).eval()
                 for execution in EXECUTIONS}
    model = copy.deepcopy(model)  # the baseline's weights allocated as the converted copies' are (loaded ones run ~1 % apart)

    @torch.no_grad()
    def forward(m):
        m(ids, use_cache=False)

    @torch.no_grad()
    def decode(m):
        m.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                   pad_token_id=0)

    def stepper(m):
        """One decode step at a fixed context: the prompt's cache, cropped back to it after each step."""
        with torch.no_grad():
            cache = DynamicCache(config=m.config)
            token = m(prompt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)

        @torch.no_grad()
        def step():
            m(token, cache=cache, use_cache=True)
            cache.crop(-1)

        return step

    measured = {kind: interleaved_ratios(lambda run=run: run(model),
                                         {e: lambda run=run, m=m: run(m) for e, m in converted.items()},
                                         repeats=args.repeats, clock=clock)
                for kind, run in (("forward", forward), ("decode", decode))}
    steps = {e: stepper(m) for e, m in converted.items()}
    measured["step"] = interleaved_ratios(stepper(model), steps, repeats=args.step_repeats, clock=clock)
    result = {"benchmark": "parallel_speed", "model": name, "tokens": ids.numel(), "layers": layers,
              "threads": torch.get_num_threads(), "clock": args.clock,
              "estimated_speedup": parallel.estimated_speedup(times, layers),
              "t_attention_total_s": sum(r["t_attention"] for r in times["layers"]),
              "t_ffn_total_s": sum(r["t_ffn"] for r in times["layers"]), "t_forward_s": times["t_forward"],
              "t_gemm_call_s": times["t_gemm_call"],
              **{f"measured_speedup_{e}": 1.0 / measured["forward"][e]["ratio_median"] for e in EXECUTIONS},
              **{f"measured_{e}": measured["forward"][e] for e in EXECUTIONS},
              "decode": {"prompt_tokens": prompt.shape[1], "new_tokens": args.new_tokens,
                         "estimated_speedup": parallel.estimated_speedup(step_times, layers),
                         "t_gemm_call_s": step_times["t_gemm_call"],
                         **{f"measured_speedup_{e}": 1.0 / measured["decode"][e]["ratio_median"] for e in EXECUTIONS},
                         **{f"measured_{e}": measured["decode"][e] for e in EXECUTIONS},
                         **{f"measured_step_speedup_{e}": 1.0 / measured["step"][e]["ratio_median"] for e in EXECUTIONS},
                         **{f"measured_step_{e}": measured["step"][e] for e in EXECUTIONS}}}
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    return result


if __name__ == "__main__":
    main()
