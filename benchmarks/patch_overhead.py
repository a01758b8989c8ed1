"""What the patch costs: ratios against the unpatched model measured in the same run.

    python benchmarks/patch_overhead.py --output benchmarks/results/cpu.json      # full (~15 min, 2 cores)
    python benchmarks/patch_overhead.py --tiny --output /tmp/tiny.json            # seconds (test suite)
    python benchmarks/make_performance_md.py benchmarks/results/*.json            # -> docs/performance.md

Suites: forward (inference time), train (forward + backward + AdamW step), memory (training-step
memory: bytes autograd saves for backward, exact; and peak RSS / CUDA peak allocation), generate
(greedy tokens/s with KV cache), compile (torch.compile'd patched vs unpatched forward, and the
graph breaks the patch adds). Timings interleave unpatched and patched runs and report medians.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import resource
import sys
import time
from pathlib import Path

import torch

import hf_tangent as ht
from hf_tangent.analysis.timing import interleaved_ratio

RULES = {
    "projected": dict(update="projected"),
    "soft": dict(update="soft", beta=0.5),
    "norm_preserving": dict(update="norm_preserving"),
    "retract_cayley": dict(update="retract", retraction="cayley"),
}
SHAPES = {
    "gpt2-small": ("gpt2", dict(n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=50257,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "llama-smollm2": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048,
                                    tie_word_embeddings=True)),
    "llama-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                               num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096)),
    "tiny": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)),
}


def build(shape: str, device: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields = SHAPES[shape]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields))
    return model.to(device)


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def forward_suite(model, ids, rule, repeats, device):
    base, patched = model, ht.patch(build_like(model, device), ht.TangentConfig(**RULES[rule]))

    @torch.no_grad()
    def run(m):
        m(ids, use_cache=False)
        sync(device)

    return interleaved_ratio(lambda: run(base), lambda: run(patched), repeats=repeats)


def build_like(model, device):
    clone = type(model)(model.config).to(device, next(model.parameters()).dtype)
    clone.load_state_dict(model.state_dict())
    return clone.eval()


def train_suite(model, ids, rule, repeats, device):
    def make(patch):
        m = build_like(model, device).train()
        if patch:
            ht.patch(m, ht.TangentConfig(**RULES[rule]))
        return m, torch.optim.AdamW(m.parameters(), lr=1e-5)

    (base, opt_b), (patched, opt_p) = make(False), make(True)

    def step(m, opt):
        m(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)

    return interleaved_ratio(lambda: step(base, opt_b), lambda: step(patched, opt_p), repeats=repeats)


def saved_bytes(model, ids) -> int:
    """Bytes of the distinct storages autograd keeps for backward (a tensor saved twice counts once)."""
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def peak_step_memory(model, ids, device) -> int:
    """Peak bytes of one training step above what was live before it (CUDA allocator or RSS)."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        model(ids, labels=ids).loss.backward()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        raise RuntimeError("CPU peak memory is measured in fresh processes (see rss_probe)")
    model.zero_grad(set_to_none=True)
    return peak


def memory_suite(model, ids, rule, device, shape, args):
    base = build_like(model, device).train()
    patched = ht.patch(build_like(model, device).train(), ht.TangentConfig(**RULES[rule]))
    saved = {"unpatched": saved_bytes(base, ids), "patched": saved_bytes(patched, ids)}
    out = {"saved_bytes_unpatched": saved["unpatched"], "saved_bytes_patched": saved["patched"],
           "saved_bytes_ratio": saved["patched"] / saved["unpatched"]}
    if device.startswith("cuda"):
        peaks = {"unpatched": peak_step_memory(base, ids, device), "patched": peak_step_memory(patched, ids, device)}
    else:  # RSS high-water marks are per process: one fresh process per variant
        import subprocess

        peaks = {}
        for variant in ("unpatched", "patched"):
            cmd = [sys.executable, __file__, "--rss-probe", variant, "--shape", shape, "--rules", rule,
                   "--seq-len", str(args.seq_len), "--batch", str(args.batch)]
            result = subprocess.run(cmd, capture_output=True, text=True, check=True)
            peaks[variant] = json.loads(result.stdout.strip().splitlines()[-1])["peak_step_bytes"]
    out |= {"peak_bytes_unpatched": peaks["unpatched"], "peak_bytes_patched": peaks["patched"],
            "peak_ratio": peaks["patched"] / peaks["unpatched"]}
    return out


def rss_probe(args):
    """Child process: peak RSS above the loaded model during one training step (first step: the
    gradients' allocation is the same for both variants; the activations are what differs)."""
    model = build(args.shape, "cpu").train()
    if args.rss_probe == "patched":
        ht.patch(model, ht.TangentConfig(**RULES[args.rules[0]]))
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len))
    gc.collect()
    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * resource.getpagesize()
    model(ids, labels=ids).loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak_step_bytes": peak - before}))


def generate_suite(model, prompt, rule, repeats, device, new_tokens):
    base = build_like(model, device)
    patched = ht.patch(build_like(model, device), ht.TangentConfig(**RULES[rule]))

    @torch.no_grad()
    def run(m):
        m.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        sync(device)

    out = interleaved_ratio(lambda: run(base), lambda: run(patched), repeats=repeats)
    # tokens/s ratio patched / unpatched = time ratio inverted
    out["tokens_per_s_ratio"] = 1.0 / out["ratio_median"]
    return out


def compile_suite(model, ids, rule, repeats, device):
    base = build_like(model, device)
    patched = ht.patch(build_like(model, device), ht.TangentConfig(**RULES[rule]))
    with torch.no_grad():
        breaks_base = torch._dynamo.explain(base)(ids, use_cache=False).graph_break_count
        torch._dynamo.reset()
        breaks_patched = torch._dynamo.explain(patched)(ids, use_cache=False).graph_break_count
        torch._dynamo.reset()
    cb, cp = torch.compile(base), torch.compile(patched)

    @torch.no_grad()
    def run(m):
        m(ids, use_cache=False)
        sync(device)

    out = interleaved_ratio(lambda: run(cb), lambda: run(cp), repeats=repeats, warmup=2)
    out |= {"graph_breaks_unpatched": breaks_base, "graph_breaks_patched": breaks_patched,
            "graph_breaks_added": breaks_patched - breaks_base}
    torch._dynamo.reset()
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["gpt2-small", "llama-smollm2"], choices=list(SHAPES))
    parser.add_argument("--shape", default="tiny", choices=list(SHAPES), help=argparse.SUPPRESS)
    parser.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES))
    parser.add_argument("--suites", nargs="+", default=["forward", "train", "memory", "generate", "compile"])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny model, short sequences, 2 repeats")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--implementation", default="fused", choices=["fused", "reference", "triton"],
                        help="how the patched model computes the rule")
    parser.add_argument("--output")
    parser.add_argument("--rss-probe", choices=["unpatched", "patched"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss_probe:
        return rss_probe(args)
    if args.tiny:
        args.shapes, args.seq_len, args.repeats, args.new_tokens = ["tiny"], 32, 2, 4
    for rule in RULES.values():
        rule["implementation"] = args.implementation
    results = {"benchmark": "patch_overhead", "device": args.device, "dtype": args.dtype,
               "implementation": args.implementation, "threads": torch.get_num_threads(),
               "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
               "seq_len": args.seq_len, "batch": args.batch, "repeats": args.repeats, "rows": []}
    for shape in args.shapes:
        model = build(shape, args.device).to(getattr(torch, args.dtype)).eval()
        ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len), device=args.device)
        prompt = ids[:, : min(32, args.seq_len)]
        for rule in args.rules:
            for suite in args.suites:
                start = time.time()
                if suite == "forward":
                    row = forward_suite(model, ids, rule, args.repeats, args.device)
                elif suite == "train":
                    row = train_suite(model, ids, rule, args.repeats, args.device)
                elif suite == "memory":
                    row = memory_suite(model, ids, rule, args.device, shape, args)
                elif suite == "generate":
                    row = generate_suite(model, prompt, rule, args.repeats, args.device, args.new_tokens)
                elif suite == "compile":
                    row = compile_suite(model, ids, rule, args.repeats, args.device)
                else:
                    raise SystemExit(f"unknown suite {suite!r}")
                row = {"shape": shape, "rule": rule, "suite": suite, "seconds": round(time.time() - start, 1), **row}
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
        del model
        gc.collect()
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
