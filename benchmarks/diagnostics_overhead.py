"""Forward time with diagnostics on vs off, same model, same run.

    python benchmarks/diagnostics_overhead.py                      # SmolLM2-135M, 4 x 512 tokens
    python benchmarks/diagnostics_overhead.py --tiny               # seconds, for the test suite
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hf_tangent.analysis import diagnostics
from hf_tangent.analysis.timing import interleaved_ratio


def build(tiny: bool):
    if tiny:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2)).eval()
        return model, "tiny-llama", torch.randint(0, 256, (2, 64))
    from hf_tangent.artifacts.models import load_model

    model, _ = load_model("smollm2-135m")
    return model, "smollm2-135m", torch.randint(0, model.config.vocab_size, (4, 512))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--output", help="write the result as JSON here")
    args = parser.parse_args(argv)
    model, name, ids = build(args.tiny)

    @torch.no_grad()
    def plain():
        model(ids, use_cache=False)

    @torch.no_grad()
    def observed():
        with diagnostics.record(model):
            model(ids, use_cache=False)

    result = {"benchmark": "diagnostics_overhead", "model": name, "tokens": ids.numel(),
              "threads": torch.get_num_threads(), **interleaved_ratio(plain, observed, repeats=args.repeats)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    return result


if __name__ == "__main__":
    main()
