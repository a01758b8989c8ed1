"""Serve a folder with vLLM (CPU, float32, eager) and write greedy tokens and their logprobs as JSON:
python tests/vllm_worker.py FOLDER OUT.json [trust] [transformers]. Run in an environment with vLLM."""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
PROMPTS = ["It is a truth universally acknowledged, that", "Emma Woodhouse, handsome, clever, and rich,",
           "The family of Dashwood had long been settled in"]
TOKENS = 32


def main():
    from vllm import LLM, SamplingParams

    kwargs = {"trust_remote_code": "trust" in sys.argv[3:]}
    if "transformers" in sys.argv[3:]:
        kwargs["model_impl"] = "transformers"
    try:
        llm = LLM(sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=512, seed=0, **kwargs)
    except Exception as err:  # noqa: BLE001 - the refusal is the result
        json.dump({"refused": f"{type(err).__name__}: {err}"}, open(sys.argv[2], "w"))
        return
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=TOKENS, logprobs=1))
    json.dump({"outputs": [{"tokens": list(o.outputs[0].token_ids),
                            "logprobs": [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)]}
                           for o in outs]}, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
