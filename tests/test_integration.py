"""The patched model keeps working with what transformers users rely on: generate and the KV
cache, gradient checkpointing, output_hidden_states, eager/SDPA, half precision, PEFT LoRA,
torch.compile."""

import pytest
import torch
from conftest import layer_output, make_tiny, spec_of

import hf_tangent as ht

pytestmark = pytest.mark.core
RULE = ht.TangentConfig(update="retract", retraction="cayley", gates=True, parallel_layers=[1])
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def tiny(arch, **overrides):
    if arch == "gpt2":
        overrides = {**NO_DROPOUT, **overrides}
    model = make_tiny(arch, **overrides)
    if arch == "gpt_neox_parallel":  # already parallel: convert nothing (no warning noise)
        return ht.patch(model, ht.TangentConfig.from_dict({**RULE.to_dict(), "parallel_layers": []}))
    return ht.patch(model, RULE)


def test_generate_same_tokens_with_and_without_kv_cache(arch, ids):
    model = tiny(arch)
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(ids, use_cache=True, **kwargs)
        uncached = model.generate(ids, use_cache=False, **kwargs)
        # and the patch is really active during generation
        plain = ht.unpatch(make_tiny(arch, **(NO_DROPOUT if arch == "gpt2" else {}))).generate(ids, **kwargs)
    assert torch.equal(cached, uncached)
    assert cached.shape == (2, 22)
    assert not torch.equal(cached, plain)


def _grads(model, ids):
    model.zero_grad()
    model(ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_gives_same_gradients(arch, ids):
    model = tiny(arch)
    model.train()
    reference = _grads(model, ids)
    assert any(n.endswith("tangent_patch.gate") for n in reference), "gates must receive gradients"
    for reentrant in (False, True):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        assert model.is_gradient_checkpointing
        grads = _grads(model, ids)
        assert grads.keys() == reference.keys()
        for name in reference:
            torch.testing.assert_close(grads[name], reference[name], rtol=1e-5, atol=1e-7, msg=name)
        model.gradient_checkpointing_disable()


def test_output_hidden_states_are_the_patched_layer_outputs(arch, ids):
    model = tiny(arch)
    layers = spec_of(model).decoder_layers(model)
    outs = {}
    handles = [layer.register_forward_hook(lambda m, a, o, k=k: outs.__setitem__(k, layer_output(o)))
               for k, layer in enumerate(layers)]
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    for h in handles:
        h.remove()
    assert len(hidden) == len(layers) + 1
    for k in range(len(layers) - 1):  # the last entry has the final norm applied
        assert torch.equal(hidden[k + 1], outs[k])


@pytest.mark.parametrize("arch_name", ["gpt2", "gpt_neox_sequential", "llama"])
def test_eager_and_sdpa_agree(arch_name, ids):
    logits = {}
    for impl in ("eager", "sdpa"):
        model = make_tiny(arch_name)
        model.config._attn_implementation = impl
        model = type(model)(model.config)
        model.load_state_dict(make_tiny(arch_name).state_dict())
        ht.patch(model.eval(), RULE)
        with torch.no_grad():
            logits[impl] = model(ids).logits
    torch.testing.assert_close(logits["eager"], logits["sdpa"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_do_update_arithmetic_in_float32(arch, ids, dtype):
    model = ht.patch(make_tiny(arch), ht.TangentConfig(update="retract", retraction="cayley")).to(dtype)
    spec = spec_of(model)
    layer = spec.decoder_layers(model)[1]
    rec = {}
    spec.submodule(layer, "ffn_norm").register_forward_pre_hook(lambda m, a: rec.__setitem__("x", a[0]))
    spec.submodule(layer, "ffn_out").register_forward_hook(lambda m, a, o: rec.__setitem__("y", layer_output(o)), prepend=True)
    spec.submodule(layer, "ffn_out").register_forward_hook(lambda m, a, o: rec.__setitem__("added", layer_output(o)))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.dtype == dtype and torch.isfinite(logits).all()
    assert rec["added"].dtype == dtype
    # float64 reference of x_next - x from the same half-precision x and y, rounded once
    x, y = rec["x"].double(), rec["y"].double()
    v = y - (x * y).sum(-1, keepdim=True) / (x * x).sum(-1, keepdim=True) * x
    r, vn = x.norm(dim=-1, keepdim=True), v.norm(dim=-1, keepdim=True)
    theta = 2 * torch.atan(vn / r / 2)
    reference = (torch.cos(theta) * x + r * torch.sin(theta) * v / vn - x).to(dtype)
    ulp = (reference.double().abs() * torch.finfo(dtype).eps).clamp_min(torch.finfo(dtype).tiny)
    assert ((rec["added"].double() - reference.double()).abs() <= ulp * 1.01).all()
    with torch.no_grad():
        full = ht.patch(make_tiny(arch), ht.TangentConfig(update="retract", retraction="cayley"))(ids).logits
    assert (logits.float() - full).abs().max() < 0.1 * full.abs().max()


def test_lora_on_top_of_the_patch_trains_and_saves(tmp_path, ids):
    from peft import LoraConfig, PeftModel, get_peft_model

    config = ht.TangentConfig(update="projected", layers=[0, 2])
    model = get_peft_model(ht.patch(make_tiny("llama"), config),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    assert ht.get_config(model) == config
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(8):
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    # the patch is still the one that runs: the added update at layer 0 is tangential
    base = model.get_base_model()
    rec = {}
    spec = spec_of(base)
    layer = spec.decoder_layers(base)[0]
    spec.submodule(layer, "ffn_norm").register_forward_pre_hook(lambda m, a: rec.__setitem__("x", a[0]))
    spec.submodule(layer, "ffn_out").register_forward_hook(lambda m, a, o: rec.__setitem__("added", o))
    model.eval()
    with torch.no_grad():
        trained = model(ids).logits
    cos = torch.nn.functional.cosine_similarity(rec["x"], rec["added"], dim=-1)
    assert cos.abs().max() < 1e-5
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(ht.patch(make_tiny("llama"), config), tmp_path / "adapter").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, trained)


@pytest.mark.parametrize("arch_name", ["gpt2", "llama", "gpt_neox_parallel"])
def test_torch_compile_fullgraph_without_graph_breaks(arch_name, ids):
    model = tiny(arch_name)
    with torch.no_grad():
        eager = model(ids).logits
        explanation = torch._dynamo.explain(model)(ids)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        compiled = torch.compile(model, fullgraph=True)
        torch.testing.assert_close(compiled(ids).logits, eager, rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()


def test_patch_is_per_instance(ids):
    a, b = make_tiny("llama"), make_tiny("llama")
    with torch.no_grad():
        reference = b(ids).logits
        ht.patch(a, ht.TangentConfig(update="zero"))
        assert torch.equal(b(ids).logits, reference)
    assert ht.get_config(b) is None


def test_deepcopy_keeps_an_independent_working_patch(ids):
    import copy

    model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected", gates=True))
    clone = copy.deepcopy(model)
    with torch.no_grad():
        assert torch.equal(clone(ids).logits, model(ids).logits)
        ht.unpatch(model)
        assert not torch.equal(clone(ids).logits, model(ids).logits)
    assert ht.get_config(clone) == ht.TangentConfig(update="projected", gates=True)
