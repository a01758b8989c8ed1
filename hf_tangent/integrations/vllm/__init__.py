"""Serving patched models with vLLM (`pip install 'hf_tangent[vllm]'`): a plugin that vLLM loads through
the `vllm.general_plugins` entry point (plugin.py) and the model classes it registers (models.py).
Nothing here is imported by `import hf_tangent`."""
