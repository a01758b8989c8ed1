"""Parallel-residual conversion: the paper's estimated speedup next to the measured one.

    python benchmarks/parallel_speed.py --k 12                 # SmolLM2-135M, lowest-C_l 12 layers
    python benchmarks/parallel_speed.py --tiny                 # seconds, for the test suite

Estimated: from measured per-layer attention / FFN times, assuming each converted layer runs them
concurrently. Measured: end-to-end forward latency of the converted model against the unconverted
one in the same run (interleaved, median), with the hook conversion and the fused execution path.
"""

from __future__ import annotations

import argparse
import copy

import torch

import hf_tangent as ht
from hf_tangent.analysis import parallel
from hf_tangent.analysis.timing import emit, interleaved_ratio


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=12, help="layers converted, lowest C_l first")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    if args.tiny:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                             num_attention_heads=4, num_key_value_heads=2)).eval()
        args.k, args.seq_len, args.repeats, name = 2, 32, 2, "tiny-llama"
    else:
        from hf_tangent.artifacts.models import load_model

        model, _ = load_model("smollm2-135m")
        name = "smollm2-135m"
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq_len))
    scores = parallel.sensitivity(model, ids)["scores"]
    layers = parallel.schedule_layers(scores, args.k, "low_c")
    times = parallel.submodule_times(model, ids, repeats=3)
    result = {"benchmark": "parallel_speed", "model": name, "tokens": ids.numel(), "layers": layers,
              "threads": torch.get_num_threads(), "estimated_speedup": parallel.estimated_speedup(times, layers),
              "t_attention_total_s": sum(r["t_attention"] for r in times["layers"]),
              "t_ffn_total_s": sum(r["t_ffn"] for r in times["layers"]), "t_forward_s": times["t_forward"]}

    @torch.no_grad()
    def run(m):
        m(ids, use_cache=False)

    for execution in ("hooks", "fused"):
        converted = ht.patch(copy.deepcopy(model), ht.TangentConfig(parallel_layers=layers, parallel_execution=execution))
        timing = interleaved_ratio(lambda: run(model), lambda conv=converted: run(conv), repeats=args.repeats)
        result[f"measured_speedup_{execution}"] = 1.0 / timing["ratio_median"]
        result[f"measured_{execution}"] = timing
    return emit(result, args.output)


if __name__ == "__main__":
    main()
