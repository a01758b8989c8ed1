"""The vLLM plugin's parts that need no vLLM (the main suite): the patched folders' config classes travel to
vLLM's engine process by pickle (vLLM's default: the engine in a process of its own)."""

import pickle

import pytest

from hf_tangent.integrations.vllm import plugin


def test_every_patched_config_pickles_and_loads_where_its_class_is_not_made_yet():
    """lm-eval --backend vllm (and vllm.LLM) failed with `PicklingError: Can't pickle <class
    '...plugin.HfTangentLlamaConfig'>: attribute lookup ... failed` when vLLM sent the config to its engine process:
    the class was made by type() and found nowhere by name. Now one class per family, found in plugin.py by name,
    made on first use: with the classes forgotten (as in the engine process, which unpickles before anything made
    them), each config loads as its model_type with the base's fields."""
    configs = []
    for base_type in plugin.SUPPORTED:
        cls = plugin.config_class(base_type)
        assert cls is plugin.config_class(base_type) and getattr(plugin, cls.__name__) is cls
        configs.append(cls(num_hidden_layers=3, vocab_size=96))
    data = pickle.dumps(configs)
    plugin.config_class.cache_clear()
    try:
        loaded = pickle.loads(data)
        for config, base_type, before in zip(loaded, plugin.SUPPORTED, configs, strict=True):
            assert type(config) is plugin.config_class(base_type) and type(config) is not type(before)
            assert type(config).__name__ == type(before).__name__ and type(config).__module__ == plugin.__name__
            assert (config.model_type, config.num_hidden_layers, config.vocab_size) == (f"hf_tangent_{base_type}", 3, 96)
            assert config.to_dict() == before.to_dict()
    finally:
        plugin.config_class.cache_clear()


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'HfTangentOPTConfig'"):
        plugin.HfTangentOPTConfig  # noqa: B018
