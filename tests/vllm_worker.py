"""Serve a folder with vLLM (CPU, float32, eager) and write greedy tokens and their logprobs as JSON:
python tests/vllm_worker.py FOLDER OUT.json [trust] [transformers] [bfloat16] [compile] [norms]. Run in an environment
with vLLM. `compile` serves with vLLM's compilation on (its CPU default: dynamo traced once, inductor); `norms` also
writes the class names of the served model's hf_tangent norms.

The worker keeps vLLM's engine inside its own process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set in main() only: importing
this module changes nothing). python tests/vllm_worker.py --loop: one process for many folders (vLLM's import, most of a serve's time, paid
once): reads lines `{"folder": ..., "out": ..., "flags": [...]}` from stdin, serves each folder with an engine
of its own (released before the next) and answers each line with the line DONE once the output is written
(vLLM's own log lines go to stdout too)."""

import gc
import json
import os
import sys

PROMPTS = ["It is a truth universally acknowledged, that", "Emma Woodhouse, handsome, clever, and rich,",
           "The family of Dashwood had long been settled in"]
TOKENS = 32
DONE = "hf_tangent vllm_worker: done"


def serve(folder: str, out: str, flags: list[str]) -> None:
    from vllm import LLM, SamplingParams

    kwargs = {"trust_remote_code": "trust" in flags}
    if "transformers" in flags:
        kwargs["model_impl"] = "transformers"
    try:
        llm = LLM(folder, dtype="bfloat16" if "bfloat16" in flags else "float32", enforce_eager="compile" not in flags,
                  max_model_len=512, seed=0, **kwargs)
    except Exception as err:  # noqa: BLE001 - the refusal is the result
        json.dump({"refused": f"{type(err).__name__}: {err}"}, open(out, "w"))
        return
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=TOKENS, logprobs=1))
        json.dump({"outputs": [{"tokens": list(o.outputs[0].token_ids),
                                "logprobs": [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids,
                                                                          strict=True)]}
                               for o in outs]}
                  | ({"norms": sorted(type(m).__name__ for model in llm.apply_model(lambda model: [model])
                                      for m in model[0].modules() if type(m).__name__.startswith("HfTangent")
                                      and type(m).__name__.endswith("Norm"))} if "norms" in flags else {}),
                  open(out, "w"))
    finally:
        del llm
        gc.collect()


def main():
    # this worker only (tests/test_vllm.py imports PROMPTS from it, and runs lm-eval through vLLM in its own process
    # as users do): the engine in this process, so that one process serves folder after folder, and a small cache
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if sys.argv[1:] == ["--loop"]:
        for line in sys.stdin:
            request = json.loads(line)
            serve(request["folder"], request["out"], request["flags"])
            print(DONE, flush=True)
        return
    serve(sys.argv[1], sys.argv[2], sys.argv[3:])


if __name__ == "__main__":
    main()
