"""What the patch adds to the hot path, counted (issue 58): Python calls per layer per decode step, and
graphs / breaks of a compiled patched model. Counts, not times: a count does not move with the machine's load.
Speed itself is measured as ratios to the unpatched model in benchmarks/ (docs/performance.md)."""

from __future__ import annotations

import collections
import gc
import sys

import pytest
import torch
from conftest import VOCAB, make_tiny
from transformers import DynamicCache, StaticCache

import hf_tangent as ht

# The budget of issue 58: at most ~12 Python calls per patched layer per decode step, all sources together
# (torch's own hook dispatch included: 3 calls per hooked module).
BUDGET = 12
RULES = {"projected": dict(update="projected"), "retract": dict(update="retract"),
         "norm_preserving": dict(update="norm_preserving"), "soft": dict(update="soft", beta=0.5),
         "parallel": dict(parallel_layers=[0, 1, 2]), "gates": dict(update="projected", gates=True),
         "fused parallel": dict(parallel_layers=[0, 1, 2], parallel_execution="fused")}
# a gate is a registered parameter: reading it goes through nn.Module.__getattr__, one Python call
EXTRA = {"gates": 1}


def _decode_calls(model) -> collections.Counter:
    """Python calls of one decode step (one token, a warm dynamic KV cache), by (file, function)."""
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    counts = collections.Counter()

    def profile(frame, event, arg):
        # dynamo's weakref callbacks fire when objects an earlier compile tracked are freed: not this call's work
        if event == "call" and "/torch/_dynamo/" not in frame.f_code.co_filename:
            counts[(frame.f_code.co_filename, frame.f_code.co_name)] += 1

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        step = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        model(step, past_key_values=cache, use_cache=True)  # warm: lazy imports and caches are filled
        gc.collect()
        gc.disable()  # a collection inside the counted call would count finalizers
        sys.setprofile(profile)
        try:
            model(step, past_key_values=cache, use_cache=True)
        finally:
            sys.setprofile(None)
            gc.enable()
    return counts


def _extra(patched: collections.Counter, base: collections.Counter) -> dict:
    return {k: patched[k] - base.get(k, 0) for k in patched if patched[k] != base.get(k, 0)}


@pytest.mark.parametrize("rule", list(RULES))
def test_a_patched_layer_adds_at_most_the_budget_of_python_calls(rule):
    """Per layer (the difference between a 6- and a 3-layer model) and per model call (the module that runs the
    layers drops what an aborted call handed on: two hooks, once per call)."""
    extra = {}
    for layers in (3, 6):
        base = _decode_calls(make_tiny("llama", num_hidden_layers=layers))
        config = dict(RULES[rule])
        if "parallel_layers" in config:
            config["parallel_layers"] = list(range(layers))
        extra[layers] = _extra(_decode_calls(ht.patch(make_tiny("llama", num_hidden_layers=layers),
                                                      ht.TangentConfig(**config))), base)
    per_layer = {k: (extra[6].get(k, 0) - extra[3].get(k, 0)) / 3 for k in set(extra[3]) | set(extra[6])}
    per_call = sum(extra[3].values()) - 3 * sum(per_layer.values())
    assert sum(per_layer.values()) <= BUDGET + EXTRA.get(rule, 0), sorted(per_layer.items(), key=lambda kv: -kv[1])
    assert per_call <= 9, extra[3]  # torch's dispatch of the two hooks, each hook and its thread key
    if rule == "fused parallel":  # its norms and projections replace the modules' own calls: tests/test_fused_parallel.py
        return
    ours = {k[1]: v for k, v in per_layer.items() if "/hf_tangent/" in k[0] and v}
    expected = {"parallel": {"_record_block_input": 1, "_record_x": 1, "call_key": 2}}.get(
        rule, {"_record_x": 1, "_apply_update": 1, "call_key": 2, "fused_residual_delta": 1, "_forward": 1})
    assert ours == expected


@pytest.mark.parametrize("config", [dict(update="projected"), dict(update="retract", p=2.0),
                                    dict(update="projected", gates=True), dict(parallel_layers=[1]),
                                    dict(update="retract", implementation="triton")],
                         ids=["projected", "retract", "gates", "parallel", "triton"])
def test_compiled_patched_model_is_one_graph_after_eager_calls(config):
    """torch.compile sees plain torch ops and no Python state it must guard on: one graph, no break, also
    after eager calls (a per-call cache key would split it), for a forward and a static-cache decode step."""
    model = ht.patch(make_tiny("llama"), ht.TangentConfig(**config))
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager = model(ids).logits  # an eager call first
        torch._dynamo.reset()
        forward = torch._dynamo.explain(model)(ids)
        cache = StaticCache(config=model.config, max_cache_len=16)
        model(ids, past_key_values=cache, use_cache=True)
        step = torch.tensor([[3]])
        decode = torch._dynamo.explain(model)(step, past_key_values=cache, use_cache=True,
                                              cache_position=torch.tensor([6]))
    torch._dynamo.reset()
    assert (forward.graph_count, forward.graph_break_count) == (1, 0), forward.break_reasons
    assert (decode.graph_count, decode.graph_break_count) == (1, 0), decode.break_reasons
    ops = {str(n.target) for g in forward.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert not any("hf_tangent" in op for op in ops), ops  # no opaque custom op: inductor can fuse the rule
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, eager, rtol=0, atol=0)
