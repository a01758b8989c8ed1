"""hf_tangent inside other tools: lm-eval (harness/: the offline tasks and a model in memory) and vLLM
(vllm/: the plugin and its model classes; vLLM is an optional extra, imported only there)."""
