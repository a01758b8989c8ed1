"""No silent wrong model (issue 14): patch state owned by one model, frozen configs, reentrant
hooks, atomic re-patches, strict reload, hooks that must fire, numerics at the edges, resume.
Each test pins a case that gave a wrong result (or a half-patched model) before."""

import copy
import json
import math
import threading

import pytest
import torch
from conftest import VOCAB, make_tiny
from safetensors.torch import load_file, save_file

import hf_tangent as ht
from hf_tangent.core.rules import residual_delta

pytestmark = pytest.mark.core
PROJECTED = ht.TangentConfig(update="projected")


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


# ----------------------------------------------------------------------------- state ownership
def test_two_models_from_one_config_keep_their_own_patch(tmp_path, ids):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    first, second = LlamaForCausalLM(config).eval(), LlamaForCausalLM(config).eval()
    assert first.config is second.config  # what transformers does
    ht.patch(first, ht.TangentConfig(update="projected", eps_mode="relative"))
    ht.patch(second, ht.TangentConfig(update="radial", eps_mode="relative"))
    assert first.config.hf_tangent["config"]["update"] == "projected"
    assert second.config.hf_tangent["config"]["update"] == "radial"
    assert not hasattr(config, "hf_tangent")  # the caller's object is left alone
    # every module of a model reads the model's own copy
    assert all(m.config is first.config for m in first.modules()
               if "config" in vars(m) and not isinstance(m, ht.TangentLayer))
    expected = logits(first, ids)
    ht.unpatch(second)
    assert first.config.hf_tangent["config"]["update"] == "projected"
    first.save_pretrained(tmp_path)
    reloaded = ht.from_pretrained(tmp_path).eval()
    assert ht.get_config(reloaded).update == "projected"
    assert torch.equal(logits(reloaded, ids), expected)


def test_from_config_twice_gives_independent_models():
    from transformers import GPT2Config

    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32)
    a = ht.from_config(config, ht.TangentConfig(update="projected"))
    b = ht.from_config(config, ht.TangentConfig(update="zero"))
    assert a.config.hf_tangent["config"]["update"] == "projected" and ht.get_config(a).update == "projected"
    assert b.config.hf_tangent["config"]["update"] == "zero"


def test_changing_the_callers_config_after_patch_changes_nothing(ids):
    cfg = ht.TangentConfig(update="soft", beta=0.5)
    model = ht.patch(make_tiny("llama"), cfg)
    before = logits(model, ids)
    cfg.beta = 1.0
    assert torch.equal(logits(model, ids), before)
    assert ht.get_config(model).beta == 0.5 and model.config.hf_tangent["config"]["beta"] == 0.5
    with pytest.raises(AttributeError, match=r"read-only.*update_config\(model, beta=...\)"):
        ht.get_config(model).beta = 0.25
    cfg.beta = 7.0  # unvalidated assignment on the caller's object: refused when it is used
    with pytest.raises(ValueError, match=r"TangentConfig.beta=7.0 is out of range"):
        ht.patch(model, cfg)
    assert torch.equal(logits(model, ids), before)


def test_update_config_is_validated_and_the_record_follows(ids):
    model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="soft", beta=0.5, gates=True))
    with torch.no_grad():
        ht.tangent_layers(model)[1].gate.fill_(0.25)
    ht.update_config(model, beta=1.0)
    assert ht.get_config(model).beta == 1.0 and model.config.hf_tangent["config"]["beta"] == 1.0
    assert ht.tangent_layers(model)[1].gate.item() == 0.25  # trained gates kept
    expected = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected", gates=True))
    with torch.no_grad():
        ht.tangent_layers(expected)[1].gate.fill_(0.25)
    assert torch.equal(logits(model, ids), logits(expected, ids))
    with pytest.raises(ValueError, match="TangentConfig.beta=7.0"):
        ht.update_config(model, beta=7.0)
    with pytest.raises(ValueError, match=r"unknown TangentConfig fields \['betta'\]"):
        ht.update_config(model, betta=0.1)
    assert ht.get_config(model).beta == 1.0


# ----------------------------------------------------------------------------- reentrancy
def test_two_threads_share_one_patched_model(ids):
    model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="retract", retraction="cayley",
                                                           parallel_layers=[1]))
    inputs = [torch.randint(0, VOCAB, (1, 6 + i % 5)) for i in range(16)]
    expected = [logits(model, x) for x in inputs]
    wrong = []

    def worker(offset):
        for k in range(40):
            i = (k + offset) % len(inputs)
            if not torch.equal(logits(model, inputs[i]), expected[i]):
                wrong.append(i)

    threads = [threading.Thread(target=worker, args=(o,)) for o in (0, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
    assert all(not any(child._pending.values()) for child in ht.tangent_layers(model))  # nothing outlives a call


def test_ffn_called_on_its_own_after_a_forward_is_unpatched(ids):
    """The patch lives on the (pre-FFN norm, FFN) pair: the FFN called alone is the plain FFN; the pair called
    alone, in the layer's order, applies the rule to the norm's input, as the layer would."""
    from hf_tangent.core.rules import residual_delta

    model = ht.patch(make_tiny("llama"), PROJECTED)
    layer = model.model.layers[1]
    h = torch.randn(1, 4, 64)
    with torch.no_grad():
        model(ids)
        normed = layer.post_attention_layernorm.forward(h)  # the norm's computation, without its hook
        alone = layer.mlp(normed)
        pair = layer.mlp(layer.post_attention_layernorm(h))
        ht.unpatch(model)
        plain = layer.mlp(layer.post_attention_layernorm(h))
    assert torch.equal(alone, plain)
    torch.testing.assert_close(pair, residual_delta(h, plain, "projected"), rtol=0, atol=1e-6)
    assert not torch.equal(pair, plain)


# ----------------------------------------------------------------------------- atomic re-patch
def test_failed_fused_repatch_keeps_patch_and_gates(ids):
    model = ht.patch(make_tiny("gpt2"), ht.TangentConfig(update="projected", gates=True))
    with torch.no_grad():
        for child in ht.tangent_layers(model):
            child.gate.fill_(0.5)
    before, record = logits(model, ids), copy.deepcopy(model.config.hf_tangent)
    with pytest.raises(ValueError, match="no fused parallel execution path"):
        ht.parallelize(model, [1], execution="fused")
    assert torch.equal(logits(model, ids), before)
    assert model.config.hf_tangent == record and [c.gate.item() for c in ht.tangent_layers(model)] == [0.5] * 3
    with pytest.raises(ValueError, match="no fused parallel execution path"):
        ht.patch(model, ht.TangentConfig(update="zero", parallel_layers=[0], parallel_execution="fused"))
    assert torch.equal(logits(model, ids), before) and ht.get_config(model).update == "projected"


def test_install_failure_rolls_back(monkeypatch, ids):
    model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected", gates=True))
    with torch.no_grad():
        ht.tangent_layers(model)[0].gate.fill_(0.75)
    before = logits(model, ids)
    calls = {"n": 0}
    original = ht.TangentLayer.install

    def failing(self, layer):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated failure while installing")
        return original(self, layer)

    monkeypatch.setattr(ht.TangentLayer, "install", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        ht.patch(model, ht.TangentConfig(update="zero"))
    monkeypatch.undo()
    assert torch.equal(logits(model, ids), before)
    assert ht.get_config(model).update == "projected" and ht.tangent_layers(model)[0].gate.item() == 0.75
    hooked = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    assert hooked == 3 * 2 + 2  # per layer: ffn_norm, ffn_out; the module that runs the layers: a call begins, ends


def test_shared_layer_object_is_refused_and_unpatch_never_fails(ids):
    model = make_tiny("llama")
    model.model.layers[2] = model.model.layers[0]
    with pytest.raises(ValueError, match="layers 0 and 2 are one module object"):
        ht.patch(model, PROJECTED)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_unpatch_through_peft(ids):
    from peft import LoraConfig, get_peft_model

    model = make_tiny("llama")
    reference = logits(model, ids)
    peft_model = get_peft_model(ht.patch(model, PROJECTED), LoraConfig(r=2, target_modules=["q_proj"]))
    assert ht.get_config(peft_model) is not None
    ht.unpatch(peft_model)
    assert ht.get_config(peft_model) is None
    assert torch.equal(logits(peft_model, ids), reference)  # LoRA B starts at 0


# ----------------------------------------------------------------------------- detection
def test_in_place_compiled_model_is_refused(ids):
    model = make_tiny("llama")
    model.compile()
    with pytest.raises(ValueError, match=r"compiled in place \(module.compile\(\)\).*patch an uncompiled model"):
        ht.patch(model, PROJECTED)
    layer_compiled = make_tiny("llama")
    layer_compiled.model.layers[1].compile()
    with pytest.raises(ValueError, match="model.layers.1 was compiled in place"):
        ht.patch(layer_compiled, PROJECTED)


def test_layer_that_bypasses_the_hooked_norm_fails_loudly(ids):
    import torch.nn.functional as F

    model = make_tiny("llama")
    layer_class = type(model.model.layers[0])

    class FunctionalNormLayer(layer_class):  # unsloth style: the class forward, norm applied functionally
        def forward(self, hidden_states, *args, **kwargs):
            norm = self.post_attention_layernorm
            return hidden_states + self.mlp(F.rms_norm(hidden_states, norm.weight.shape, norm.weight,
                                                       norm.variance_epsilon))

    before = logits(model, ids)
    for layer in model.model.layers:
        layer.__class__ = FunctionalNormLayer
    bypassing = logits(model, ids)
    with pytest.raises(ValueError, match=r"did not verify: in layer 0, its ffn_norm module 'post_attention_layernorm' "
                                         r"was not called exactly once"):
        ht.patch(model, PROJECTED)  # refused when the patch is made (a verified class of the same config is no pass)
    assert ht.get_config(model) is None and torch.equal(logits(model, ids), bypassing)
    for layer in model.model.layers:  # the layer's forward replaced after the patch: the call fails loudly
        layer.__class__ = layer_class
    ht.patch(model, PROJECTED)
    for layer in model.model.layers:
        layer.__class__ = FunctionalNormLayer
    with pytest.raises(RuntimeError, match=r"layer 0 .* without calling its ffn_norm submodule"):
        model(ids)
    for layer in model.model.layers:
        layer.__class__ = layer_class
    ht.unpatch(model)
    assert torch.equal(logits(model, ids), before)


# ----------------------------------------------------------------------------- numerics
def test_relative_eps_is_per_token(ids):
    x, y = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    x[0, 2] = float("nan")
    x[0, 3] = 0.0
    for implementation in ("reference", "fused"):
        cfg = ht.TangentConfig(update="projected", eps_mode="relative", implementation=implementation)
        layer = ht.TangentLayer(cfg, 0, update=True, parallel=False)
        delta = layer(x, y)
        assert torch.isfinite(delta[1]).all() and torch.isfinite(delta[0, [0, 1, 3, 4]]).all()
        assert torch.equal(delta[0, 3], y[0, 3])  # x = 0: c = 0, the update is y
        xd, yd = x[1].double(), y[1].double()
        c = (xd * yd).sum(-1, keepdim=True) / ((xd * xd).sum(-1, keepdim=True) * (1 + 1e-6))
        torch.testing.assert_close(delta[1].double(), yd - c * xd, rtol=1e-5, atol=1e-6)


def test_nan_in_one_sequence_stays_in_that_sequence(ids):
    model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected", eps_mode="relative"))
    clean = logits(model, ids)
    embed = model.model.embed_tokens
    poisoned = ids.clone()
    poisoned[0, 3] = 5
    hook = embed.register_forward_hook(lambda m, a, o: o.index_put((torch.tensor([0]), torch.tensor([3])),
                                                                   torch.tensor(float("nan"))))
    out = logits(model, poisoned)
    hook.remove()
    assert torch.isnan(out[0]).any() and torch.equal(out[1], clean[1])


def test_retract_keeps_zero_state_at_zero():
    x, y = torch.zeros(3, 8), torch.randn(3, 8)
    for implementation in ("reference", "fused"):
        cfg = ht.TangentConfig(update="retract", retraction="cayley", implementation=implementation)
        x_req, y_req = x.clone().requires_grad_(), y.clone().requires_grad_()
        delta = ht.TangentLayer(cfg, 0, update=True, parallel=False)(x_req, y_req)
        assert torch.equal(delta, torch.zeros_like(delta))
        delta.sum().backward()
        assert torch.isfinite(x_req.grad).all() and torch.isfinite(y_req.grad).all()


def test_fp16_retraction_does_not_overflow_where_x_next_fits():
    torch.manual_seed(0)
    x = torch.randn(8, 64) * 1000
    x[:, 0] = 40000.0  # ||x||_inf > 32.7k: x_next - x can exceed fp16's 65504
    y = torch.randn(8, 64) * 16000  # ||P_u y|| ~ pi ||x||: the exponential map turns x about half way round
    x16, y16 = x.half(), y.half()
    exact = x16.double() + residual_delta(x16.double(), y16.double(), "retract", p=math.inf)  # x_next
    needs = (exact - x16.double()).abs().max(-1).values > 65504
    assert needs.any() and (exact.abs() < 65504).all()  # the case: delta out of range, x_next in range
    for delta in (residual_delta, ht.core.fused.fused_residual_delta):
        out = x16 + delta(x16, y16, "retract", p=math.inf)  # the model's own add, in fp16
        assert torch.isfinite(out).all(), delta
        close = ~needs  # elsewhere the add lands on x_next (to fp16 rounding)
        torch.testing.assert_close(out[close].double(), exact[close], rtol=2e-3, atol=64)


def test_config_refuses_values_that_cannot_stay_finite():
    with pytest.raises(ValueError, match=r"TangentConfig.alpha=1e\+39 is out of range; accepted: a number >= -1e\+06 and <= 1e\+06\."):
        ht.TangentConfig(update="projected", alpha=1e39)
    with pytest.raises(ValueError, match="retraction='exp' means p=inf, but p=1.0 was also given"):
        ht.TangentConfig(update="retract", retraction="exp", p=1.0)
    assert ht.TangentConfig(update="retract", retraction="exp").p == math.inf
    assert ht.TangentConfig(update="retract", retraction="proj", p=1.0).p == 1.0
    with pytest.raises(ValueError, match="TangentConfig.eps=1e-50"):
        ht.TangentConfig(eps=1e-50)
    with pytest.raises(ValueError, match="TangentConfig.p='fast'"):
        ht.TangentConfig.from_dict({"update": "retract", "p": "fast"})


# ----------------------------------------------------------------------------- strict reload
def saved(tmp_path, config=None):
    config = config or ht.TangentConfig(update="soft", beta=0.3, layers=[0, 2], gates=True)
    model = ht.patch(make_tiny("llama"), config)
    model.save_pretrained(tmp_path)
    return model


def edit(path, fn):
    data = json.loads((path / "config.json").read_text())
    fn(data)
    (path / "config.json").write_text(json.dumps(data))


@pytest.mark.parametrize("change, message", [
    (lambda d: d["hf_tangent"]["config"].update(layers=[0]),
     r"'patched_layers' \[0, 2\] disagrees with config.layers \[0\]"),
    (lambda d: d["hf_tangent"]["config"].update(gates=False),
     r"gates are saved for layers \[0, 2\], the patch gates layers \[\] \(config.gates is false\)"),
    (lambda d: d["hf_tangent"].pop("config"), r"field 'hf_tangent.config' is missing"),
    (lambda d: d["hf_tangent"].update(num_layers="3"), r"field 'hf_tangent.num_layers' must be a int, got '3'"),
    (lambda d: d["hf_tangent"].update(patched_layers=[0, "x"]), r"'hf_tangent.patched_layers' must list layer indices"),
    (lambda d: d["hf_tangent"]["config"].update(p="fast"), r"field 'hf_tangent.config': TangentConfig.p='fast'"),
    (lambda d: d["hf_tangent"]["config"].update(beta=[1]), r"field 'hf_tangent.config': TangentConfig.beta=\[1\]"),
    (lambda d: d.update(hf_tangent=[1, 2]), r"field 'hf_tangent' must be a mapping"),
    (lambda d: d["hf_tangent"].update(parallel_layers=[1]), r"'parallel_layers' \[1\] disagrees"),
])
def test_malformed_or_contradictory_records_name_file_and_field(tmp_path, change, message):
    saved(tmp_path)
    edit(tmp_path, change)
    with pytest.raises(ValueError, match=message) as err:
        ht.from_pretrained(tmp_path)
    assert "config.json" in str(err.value)


def test_damaged_weights_name_the_file(tmp_path):
    saved(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match=r"model.safetensors: not a readable safetensors file"):
        ht.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json: not a valid JSON file"):
        ht.from_pretrained(tmp_path)


def test_bad_gate_tensors_and_foreign_weights_are_named(tmp_path):
    saved(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.0.tangent_patch.gate"] = torch.ones(3)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model.layers.0.tangent_patch.gate' must be a floating-point gate of shape \(1,\)"):
        ht.from_pretrained(tmp_path)
    weights["model.layers.0.tangent_patch.gate"] = torch.ones(1)
    weights["model.layers.0.extra.weight"] = torch.ones(2)
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as err:
        ht.from_pretrained(tmp_path)
    assert "missing from the weights: ['model.layers.1.mlp.up_proj.weight']" in str(err.value)
    assert "not in the model: ['model.layers.0.extra.weight']" in str(err.value)


def test_old_scalar_gates_still_load(tmp_path, ids):
    model = saved(tmp_path)
    with torch.no_grad():
        for child in ht.tangent_layers(model):
            child.gate.fill_(0.5 + child.index)
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    for key in [k for k in weights if k.endswith("tangent_patch.gate")]:
        weights[key] = weights[key].reshape(())  # the 0-dim format of releases before 0.2
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reloaded = ht.from_pretrained(tmp_path).eval()
    assert [tuple(c.gate.shape) for c in ht.tangent_layers(reloaded)] == [(1,), (1,)]
    assert [c.gate.item() for c in ht.tangent_layers(reloaded)] == [0.5, 2.5]
    assert torch.equal(logits(reloaded, ids), logits(model, ids))


# ----------------------------------------------------------------------------- resume
def test_resume_uses_the_newest_complete_checkpoint(tmp_path):
    from hf_tangent.training.trainer import last_complete_checkpoint, train

    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-4").mkdir()  # killed while saving: empty
    with pytest.warns(UserWarning, match=r"skipping incomplete checkpoints \['checkpoint-4'\]"):
        assert last_complete_checkpoint(str(tmp_path)).endswith("checkpoint-2")
    empty = tmp_path / "fresh"
    empty.mkdir()

    class Args:
        output_dir = str(empty)
        resume_from_checkpoint = "last"

    with pytest.raises(ValueError, match="--resume_from_checkpoint last: no complete checkpoint"):
        train(make_tiny("llama"), None, Args())
    Args.resume_from_checkpoint = str(tmp_path / "checkpoint-4")
    with pytest.raises(ValueError, match="checkpoint-4: not a complete Trainer checkpoint"):
        train(make_tiny("llama"), None, Args())


# ----------------------------------------------------------------------------- issue 58's lean hooks: review findings
def test_an_aborted_call_leaves_nothing_for_a_later_standalone_ffn(ids):
    """An exception between the norm's pre-hook and the FFN's hook (an out-of-memory error inside the MLP) left
    x behind for the thread, and a later standalone FFN call applied the rule with that stale x."""
    model = ht.patch(make_tiny("llama"), PROJECTED)
    mlp = model.model.layers[0].mlp

    def out_of_memory(module, args):
        raise RuntimeError("simulated OOM")

    handle = mlp.up_proj.register_forward_pre_hook(out_of_memory)
    with pytest.raises(RuntimeError, match="simulated OOM"):
        model(ids)
    handle.remove()
    assert all(not any(child._pending.values()) for child in ht.tangent_layers(model))
    t = torch.randn(2, 12, 64)
    with torch.no_grad():
        alone = mlp(t)
        with ht.disabled(model):
            assert torch.equal(alone, mlp(t))
    with torch.no_grad():  # and a norm called on its own hands nothing to the next model call's FFN
        model.model.layers[0].post_attention_layernorm(t)
        assert torch.equal(model(ids).logits, logits(ht.patch(make_tiny("llama"), PROJECTED), ids))


def test_a_hook_on_the_layer_may_call_its_ffn(ids):
    """The check for a bypassed norm read any frame of the layer's call as its forward: a user's forward hook on
    the layer that calls the FFN raised 'ran without calling its ffn_norm submodule'."""
    model = ht.patch(make_tiny("llama"), PROJECTED)
    seen = []
    model.model.layers[1].register_forward_hook(lambda m, a, o: seen.append(m.mlp(o[0] if isinstance(o, tuple) else o)))
    with torch.no_grad():
        model(ids)
    assert len(seen) == 1


def test_gates_of_an_offloaded_model_are_loaded_by_accelerate(ids):
    """The rule was called without calling the patch's child module, so accelerate's offload hook on it never
    moved the gate off the meta device: the forward failed."""
    from accelerate import cpu_offload

    model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected", gates=True))
    with torch.no_grad():
        for child in ht.tangent_layers(model):
            child.gate.fill_(0.6)
    before = logits(model, ids)
    cpu_offload(model, execution_device=torch.device("cpu"))
    assert ht.tangent_layers(model)[0].gate.is_meta
    assert torch.equal(logits(model, ids), before)
