"""patch / unpatch on tiny random models of every architecture, checked against computations
written out here: a patched layer k must output  out_unpatched - y + delta(x, y)."""

import math

import pytest
import torch
from conftest import VOCAB, layer_output, make_tiny, spec_of

import hf_tangent as ht

pytestmark = pytest.mark.core
K = 1  # the layer the single-layer tests patch


def run_capture(model, ids, k=K):
    """Logits plus, at layer k: x (FFN norm input as used), y (raw FFN output), the update actually
    added (FFN output after hf_tangent's hook) and the layer output."""
    spec = spec_of(model)
    layer = spec.decoder_layers(model)[k]
    rec = {}
    handles = [
        spec.submodule(layer, "ffn_norm").register_forward_pre_hook(lambda m, a: rec.__setitem__("x", a[0])),
        spec.submodule(layer, "ffn_out").register_forward_hook(
            lambda m, a, o: rec.__setitem__("y", layer_output(o)), prepend=True),
        spec.submodule(layer, "ffn_out").register_forward_hook(lambda m, a, o: rec.__setitem__("added", layer_output(o))),
        layer.register_forward_hook(lambda m, a, o: rec.__setitem__("out", layer_output(o))),
    ]
    try:
        with torch.no_grad():
            rec["logits"] = model(ids).logits
    finally:
        for h in handles:
            h.remove()
    return {k: v.double() for k, v in rec.items()}


def expected_delta(config, x, y):
    """x_next - x, from math.md, in float64, independent of hf_tangent.core.rules."""
    dot = (x * y).sum(-1, keepdim=True)
    c = dot / (x * x).sum(-1, keepdim=True)
    y_tan = y - c * x
    if config.update == "add":
        return config.alpha * y
    if config.update == "projected":
        return config.alpha * y_tan
    if config.update == "soft":
        return config.alpha * (y - config.beta * c * x)
    if config.update == "norm_preserving":
        return config.alpha * y_tan * y.norm(dim=-1, keepdim=True) / y_tan.norm(dim=-1, keepdim=True)
    if config.update == "radial":
        return config.alpha * c * x
    if config.update == "zero":
        return torch.zeros_like(y)
    v = config.alpha * y_tan
    r = x.norm(dim=-1, keepdim=True)
    t = v.norm(dim=-1, keepdim=True) / r
    theta = t if math.isinf(config.p) else config.p * torch.atan(t / config.p)
    return r * (torch.cos(theta) * x / r + torch.sin(theta) * v / v.norm(dim=-1, keepdim=True)) - x


RULES = [
    ht.TangentConfig(update="add", alpha=0.7),
    ht.TangentConfig(update="projected"),
    ht.TangentConfig(update="soft", beta=0.5),
    ht.TangentConfig(update="norm_preserving"),
    ht.TangentConfig(update="radial"),
    ht.TangentConfig(update="zero"),
    ht.TangentConfig(update="retract", retraction="proj"),
    ht.TangentConfig(update="retract", retraction="cayley"),
    ht.TangentConfig(update="retract", retraction="exp", alpha=1.5),
    ht.TangentConfig(update="retract", p=4.0),
]


@pytest.mark.parametrize("rule", RULES, ids=lambda c: f"{c.update}-a{c.alpha}-b{c.beta}-p{c.p}")
def test_patched_layer_matches_independent_computation(arch, ids, rule):
    model = make_tiny(arch)
    plain = run_capture(model, ids)
    config = ht.TangentConfig.from_dict({**rule.to_dict(), "layers": [K]})
    patched = run_capture(ht.patch(model, config), ids)
    assert torch.equal(patched["x"], plain["x"]) and torch.equal(patched["y"], plain["y"])
    expected = plain["out"] - plain["y"] + expected_delta(config, plain["x"], plain["y"])
    scale = plain["out"].abs().max()
    torch.testing.assert_close(patched["out"], expected, rtol=0, atol=2e-6 * scale)
    assert not torch.allclose(patched["logits"], plain["logits"]), "the rule must change this model's logits"


def test_projected_leaves_no_radial_component(arch, ids):
    model = ht.patch(make_tiny(arch), ht.TangentConfig(update="projected"))
    for k in range(3):
        rec = run_capture(model, ids, k)
        x, added = rec["x"], rec["added"]
        radial = (x * added).sum(-1).abs() / (x.norm(dim=-1) * added.norm(dim=-1))
        assert radial.max() < 1e-5
        natural = (x * rec["y"]).sum(-1).abs() / (x.norm(dim=-1) * rec["y"].norm(dim=-1))
        assert natural.max() > 1e-2  # the unprojected FFN output does have a radial part


@pytest.mark.parametrize("p", [1.0, 2.0, math.inf])
def test_retract_keeps_residual_norm(ids, p):
    for arch in ("gpt2", "gpt_neox_sequential", "llama", "mistral"):  # sequential blocks: x_next = x + delta
        model = ht.patch(make_tiny(arch), ht.TangentConfig(update="retract", p=p, alpha=3.0))
        for k in range(3):
            rec = run_capture(model, ids, k)
            torch.testing.assert_close(rec["out"].norm(dim=-1), rec["x"].norm(dim=-1), rtol=1e-5, atol=0)


def test_norm_preserving_keeps_ffn_update_norm(arch, ids):
    model = ht.patch(make_tiny(arch), ht.TangentConfig(update="norm_preserving"))
    rec = run_capture(model, ids)
    torch.testing.assert_close(rec["added"].norm(dim=-1), rec["y"].norm(dim=-1), rtol=1e-5, atol=0)


def test_add_and_unpatch_are_bit_identical(arch, ids):
    model = make_tiny(arch)
    with torch.no_grad():
        reference = model(ids).logits
        for config in (ht.TangentConfig(), ht.TangentConfig(update="add", gates=True),
                       ht.TangentConfig(update="soft", beta=0.0)):
            assert torch.equal(ht.patch(model, config)(ids).logits, reference), config
        ht.patch(model, ht.TangentConfig(update="retract", retraction="cayley", gates=True, parallel_layers=[0]))
        assert not torch.equal(model(ids).logits, reference)
        ht.unpatch(model)
        assert torch.equal(model(ids).logits, reference)
    assert ht.get_config(model) is None and not hasattr(model.config, "hf_tangent")
    assert not any("tangent" in name for name, _ in model.named_modules())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_soft_beta_one_equals_projected(arch, ids):
    model = make_tiny(arch)
    with torch.no_grad():
        projected = ht.patch(model, ht.TangentConfig(update="projected"))(ids).logits
        soft = ht.patch(model, ht.TangentConfig(update="soft", beta=1.0))(ids).logits
    assert torch.equal(projected, soft)


def test_layers_outside_selection_are_untouched(arch, ids):
    model = make_tiny(arch)
    plain = [run_capture(model, ids, k) for k in range(3)]
    ht.patch(model, ht.TangentConfig(update="projected", layers=[-2]))  # layer 1 only
    patched = [run_capture(model, ids, k) for k in range(3)]
    assert torch.equal(patched[0]["out"], plain[0]["out"])
    assert not torch.equal(patched[1]["out"], plain[1]["out"])
    layers = spec_of(model).decoder_layers(model)
    for k in (0, 2):  # no child, no hook: layer 2 computes the same function of its input
        assert "tangent_patch" not in layers[k]._modules
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in layers[k].modules())


def test_patching_again_replaces_the_patch(ids):
    model = make_tiny("llama")
    with torch.no_grad():
        projected = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected"))(ids).logits
        ht.patch(model, ht.TangentConfig(update="radial", gates=True, parallel_layers=[1]))
        ht.patch(model, ht.TangentConfig(update="projected"))
        assert torch.equal(model(ids).logits, projected)
    assert ht.get_config(model) == ht.TangentConfig(update="projected")
    assert not any("tangent_patch" in n for n, _ in model.named_parameters())


def test_gates_scale_the_ffn_update(arch, ids):
    model = make_tiny(arch)
    plain = run_capture(model, ids)
    ht.patch(model, ht.TangentConfig(update="add", gates=True))
    gates = dict(ht.tangent_layers(model)[K].named_parameters())
    assert list(gates) == ["gate"] and gates["gate"].item() == 1.0 and gates["gate"].requires_grad
    with torch.no_grad():
        gates["gate"].fill_(0.3)
    patched = run_capture(model, ids)
    torch.testing.assert_close(patched["out"], plain["out"] - 0.7 * plain["y"], rtol=0, atol=1e-6 * plain["out"].abs().max())
    names = [n for n, _ in model.named_parameters() if n.endswith("tangent_patch.gate")]
    assert len(names) == 3 and all(n in model.state_dict() for n in names)


@pytest.mark.parametrize("arch_name", ["gpt2", "gpt_neox_sequential", "llama", "mistral"])
def test_parallel_conversion_feeds_the_ffn_the_block_input(arch_name, ids):
    model = make_tiny(arch_name)
    spec = spec_of(model)
    layer = spec.decoder_layers(model)[K]
    block_input = {}
    h = layer.register_forward_pre_hook(lambda m, a, kw: block_input.__setitem__("h", (a[0] if a else kw["hidden_states"])),
                                        with_kwargs=True)
    plain = run_capture(model, ids)
    h.remove()
    # x + A(x) + FFN(Norm(x)) = (x + A(x) + FFN(Norm(x + A))) - FFN(Norm(x + A)) + FFN(Norm(x))
    with torch.no_grad():
        ffn_on_block_input = spec.submodule(layer, "mlp")(spec.submodule(layer, "ffn_norm")(block_input["h"])).double()
    ht.patch(model, ht.TangentConfig(parallel_layers=[K]))
    converted = run_capture(model, ids)
    expected = plain["out"] - plain["y"] + ffn_on_block_input
    torch.testing.assert_close(converted["out"], expected, rtol=0, atol=2e-6 * plain["out"].abs().max())
    assert torch.equal(converted["x"], block_input["h"].double())


def test_parallel_conversion_composes_with_a_rule(ids):
    model = make_tiny("llama")
    ht.patch(model, ht.TangentConfig(update="projected", layers=[K], parallel_layers=[K]))
    rec = run_capture(model, ids)
    radial = (rec["x"] * rec["added"]).sum(-1).abs() / (rec["x"].norm(dim=-1) * rec["added"].norm(dim=-1))
    assert radial.max() < 1e-5


def test_parallel_on_parallel_neox_is_a_noop_with_warning(ids):
    model = make_tiny("gpt_neox_parallel")
    with torch.no_grad():
        reference = model(ids).logits
        with pytest.warns(UserWarning, match=r"layers \[0, 2\] are already parallel-residual"):
            ht.patch(model, ht.TangentConfig(parallel_layers=[0, 2]))
        assert torch.equal(model(ids).logits, reference)


def test_supported_model_types_and_registry_extension():
    assert {"gpt2", "gpt_neox", "llama", "mistral"} <= set(ht.supported_model_types())
    with pytest.raises(ValueError, match="already registered"):
        ht.register_architecture(model_type="llama", layers="model.layers", input_norm="a", attention="b",
                                 ffn_norm="c", mlp="d")


@pytest.mark.parametrize("field, value, error, words", [
    ("model_type", 123, "OptionTypeError", "model_type=123 has the wrong type (int); accepted: a string."),
    ("mlp", "  ", "RangeError", "mlp='  ' is out of range; accepted: a string, or None, never an empty one."),
    ("source", "guessed", "ChoiceError", "source='guessed' is not one of the choices; accepted: one of 'registry', "
                                         "'discovered'."),
    ("fused_ffn_in", "mlp.up_proj", "OptionTypeError", "fused_ffn_in='mlp.up_proj' has the wrong type (str); accepted: "
                                                       "a list of strings."),
    ("fused_ffn_in", ["mlp.up_proj", 3], "OptionTypeError", "fused_ffn_in=['mlp.up_proj', 3] has the wrong type (list); "
                                                            "accepted: a list of strings."),
    ("fused_ffn_in", ["mlp.up_proj", " "], "RangeError", "fused_ffn_in=['mlp.up_proj', ' '] is out of range; accepted: a "
                                                         "list of strings, never an empty one."),
    ("layers", ("model.layers",), "OptionTypeError", "layers=('model.layers',) has the wrong type (tuple); accepted: a "
                                                     "string."),
    ("parallel", 1, "OptionTypeError", "parallel=1 has the wrong type (int); accepted: true or false."),
])
def test_register_architecture_checks_its_fields_as_every_option(field, value, error, words):
    """An architecture's fields are options of the API too: checked by core/checks.py, in the words of every
    door (they were checked by hand, as 'ArchitectureSpec.x=... is not valid'), and nothing is registered."""
    fields = dict(model_type="checked_type", layers="model.layers", input_norm=None, attention=None, ffn_norm="norm",
                  mlp="mlp")
    with pytest.raises(ValueError) as err:
        ht.register_architecture(**{**fields, field: value})
    assert type(err.value).__name__ == error and str(err.value) == f"ArchitectureSpec.{words}"
    assert "checked_type" not in ht.supported_model_types()
    spec = ht.ArchitectureSpec(**fields, fused_ffn_in=["mlp.up_proj"])
    assert spec.fused_ffn_in == ("mlp.up_proj",) and hash(spec)  # a list is kept as a tuple: specs stay hashable


def assert_untouched(model, ids, reference):
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference)
    assert ht.get_config(model) is None and not hasattr(model.config, "hf_tangent")
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_post_ln_model_is_refused_by_discovery(ids):
    from transformers import BertConfig, BertForMaskedLM

    model = BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=64))
    with pytest.raises(ValueError, match=r"model_type 'bert' has no registry entry and discovery failed: in layer 0 "
                                         r"\(BertLayer\), .*post-LN.*register_architecture"):
        ht.patch(model, ht.TangentConfig(update="projected"))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_out_of_range_layers_leave_model_unpatched(ids):
    model = make_tiny("gpt2")
    with torch.no_grad():
        reference = model(ids).logits
    with pytest.raises(ValueError, match=r"layer index 3 is out of range for a model with 3 layers; accepted: -3\.\.2"):
        ht.patch(model, ht.TangentConfig(update="projected", layers=[0, 3]))
    assert_untouched(model, ids, reference)
    with pytest.raises(ValueError, match=r"parallel_layers: layer index -4"):
        ht.patch(model, ht.TangentConfig(update="projected", parallel_layers=[-4]))
    assert_untouched(model, ids, reference)


def test_failed_repatch_keeps_the_previous_patch(ids):
    model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected"))
    with torch.no_grad():
        reference = model(ids).logits
    with pytest.raises(ValueError, match="out of range"):
        ht.patch(model, ht.TangentConfig(update="zero", layers=[7]))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference)
    assert ht.get_config(model) == ht.TangentConfig(update="projected")


def test_a_model_sharing_a_patched_models_config_leaves_it_alone(ids, monkeypatch, tmp_path):
    """B built from A's config object (transformers shares it): B's patch is B's own. Before, patching B took the record
    and the class that saves the patched format off A's config; and a patch of B that failed wrapped that class
    twice, so that A, once unpatched, still saved in the patched format (and was refused, having no record), and B
    kept a staged save_pretrained it did not have before."""
    import copy
    import json

    from transformers import AutoModelForCausalLM

    a = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected"))
    config, kind, record = a.config, type(a.config), copy.deepcopy(a.config.hf_tangent)
    b = AutoModelForCausalLM.from_config(config)
    assert b.config is config and ht.get_config(b) is None

    def boom(self, layer):
        raise RuntimeError("boom")

    with monkeypatch.context() as patched:
        patched.setattr(ht.TangentLayer, "install", boom)
        with pytest.raises(RuntimeError, match="boom"):
            ht.patch(b, ht.TangentConfig(update="zero"))
    assert b.config is config and type(config) is kind and config.hf_tangent == record and "save_pretrained" not in vars(b)
    ht.patch(b, ht.TangentConfig(update="zero"))
    assert b.config is not config and type(a.config) is kind and a.config.hf_tangent == record
    assert ht.get_config(b).update == "zero" and ht.get_config(a).update == "projected"
    ht.unpatch(b)
    # an unpatched model on A's config (it would save A's patch): unpatch gives it a config of its own without it
    c = AutoModelForCausalLM.from_config(a.config)
    ht.unpatch(c)
    assert c.config is not a.config and not hasattr(c.config, "hf_tangent") and type(c.config) is kind.__mro__[1]
    assert type(a.config) is kind and a.config.hf_tangent == record and ht.get_config(a).update == "projected"
    c.save_pretrained(tmp_path / "c")
    assert json.loads((tmp_path / "c" / "config.json").read_text())["model_type"] == "llama"
    ht.unpatch(a)
    a.save_pretrained(tmp_path / "a")
    assert json.loads((tmp_path / "a" / "config.json").read_text())["model_type"] == "llama"


def test_a_module_that_holds_patched_layers_but_not_their_patch_is_refused(ids):
    """`ht.unpatch(model.model)` of a patched model took the patch off its layers while the model still counted as
    patched (and saved the patch); the reverse too: unpatch of the model that holds a patched `model.model`. Patching
    `model.model` of a patched model ran another rule under the model's record, and `disabled(model.model)` let the
    model be unpatched inside the block, its hooks back without a config after it: refused the same way."""
    outer = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected"))
    with torch.no_grad():
        before = outer(ids).logits
    for call in (ht.unpatch, lambda m: ht.patch(m, ht.TangentConfig(update="retract")), lambda m: ht.disabled(m).__enter__()):
        with pytest.raises(ValueError, match="holds patched layers, but the patch belongs to the module that was patched"):
            call(outer.model)
    with torch.no_grad():
        assert torch.equal(outer(ids).logits, before)
    assert len(ht.tangent_layers(outer)) == len(outer.model.layers) and ht.get_config(outer).update == "projected"
    assert ht.get_config(outer.model) is None and outer.config.hf_tangent["config"]["update"] == "projected"
    inner = make_tiny("llama")
    ht.patch(inner.model, ht.TangentConfig(update="projected"))
    for call in (ht.unpatch, lambda m: ht.patch(m, ht.TangentConfig(update="retract")), lambda m: ht.disabled(m).__enter__()):
        with pytest.raises(ValueError, match="pass that module"):
            call(inner)
    compiled = torch.compile(outer)
    with pytest.raises(ValueError, match="through torch.compile its `_orig_mod`"):
        ht.unpatch(compiled)
    ht.unpatch(inner.model)
    assert ht.get_config(inner.model) is None and not ht.tangent_layers(inner)


def test_a_patch_that_cannot_be_put_back_after_a_block_leaves_the_model_unpatched(ids, monkeypatch):
    """If putting the patch back fails on leaving `disabled` (here: the second layer's install), the model was left
    half-patched (some layers hooked, no config); now it is left unpatched, exactly, with an error that says so."""
    model = make_tiny("llama")
    with torch.no_grad():
        plain = model(ids).logits
    ht.patch(model, ht.TangentConfig(update="projected"))
    install, calls = ht.TangentLayer.install, []

    def second_fails(self, layer):
        calls.append(layer)
        if len(calls) == 2:
            raise RuntimeError("boom")
        install(self, layer)

    with pytest.raises(RuntimeError, match="could not be put back after the block .*boom.* left unpatched"):
        with ht.disabled(model):
            monkeypatch.setattr(ht.TangentLayer, "install", second_fails)
    monkeypatch.undo()
    assert ht.get_config(model) is None and not ht.tangent_layers(model) and not hasattr(model.config, "hf_tangent")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain)
    ht.patch(model, ht.TangentConfig(update="projected"))
    assert len(ht.tangent_layers(model)) == len(model.model.layers)

    def interrupted(self, layer):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # as it is, not as a RuntimeError; the model unpatched all the same
        with ht.disabled(model):
            monkeypatch.setattr(ht.TangentLayer, "install", interrupted)
    monkeypatch.undo()
    assert ht.get_config(model) is None and not ht.tangent_layers(model)
    ht.patch(model, ht.TangentConfig(update="projected"))  # not left inside the block: patching is allowed


def test_wrapped_models_are_refused(ids):
    from peft import LoraConfig, get_peft_model

    model = make_tiny("llama")
    with torch.no_grad():
        reference = model(ids).logits
    layer = model.model.layers[0]
    layer.forward = lambda *args, **kwargs: args[0]  # another tool's replacement computation
    with pytest.raises(ValueError, match="layer 0 .* forward replaced on the instance"):
        ht.patch(model, ht.TangentConfig(update="projected"))
    del layer.forward
    layer.forward = layer.forward  # the class's own forward bound on the instance (transformers 4.x does this)
    ht.unpatch(ht.patch(model, ht.TangentConfig(update="projected")))
    del layer.forward
    assert_untouched(model, ids, reference)

    compiled = torch.compile(model)
    with pytest.raises(ValueError, match="already torch.compile'd; patch first"):
        ht.patch(compiled, ht.TangentConfig(update="projected"))

    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"already wrapped by PEFT; apply hf_tangent.patch first"):
        ht.patch(peft_model, ht.TangentConfig(update="projected"))
    with pytest.raises(TypeError, match="expects a TangentConfig"):
        ht.patch(make_tiny("llama"), {"update": "projected"})


def test_repr_shows_the_patch():
    model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="retract", retraction="cayley", layers=[0]))
    text = repr(model)
    assert "TangentLayer(layer=0, update=retract, p=2.0" in text and text.count("TangentLayer") == 1


@pytest.mark.parametrize("model_type", ["qwen2", "gemma2"])
def test_one_entry_architectures(model_type, ids):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=128, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        reference = model(ids).logits
    # Default init leaves ||x||^2 ~ 0.03, where an absolute eps of 1e-6 shows: use the relative form.
    ht.patch(model, ht.TangentConfig(update="projected", eps_mode="relative"))
    rec = run_capture(model, ids, 0)
    radial = (rec["x"] * rec["added"]).sum(-1).abs() / (rec["x"].norm(dim=-1) * rec["added"].norm(dim=-1))
    assert radial.max() < 1e-5
    ht.unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference)


def test_patch_saved_is_patch_without_the_probe(ids, monkeypatch):
    """install.patch_saved (vLLM's Transformers backend: no forward can run while it patches): the same patch
    as `patch`, bit for bit, with the verification probe never called; refused where the spec would have to
    be discovered by that probe (no registry entry, no saved spec)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    import hf_tangent.core.install as install

    config = ht.TangentConfig(update="projected", gates=True, parallel_layers=[1])
    reference = ht.patch(make_tiny("llama"), config)
    with torch.no_grad():
        want = reference(ids).logits

    def no_probe(*args, **kwargs):
        raise AssertionError("the probe ran")

    monkeypatch.setattr(ht.core.discovery, "require_verified", no_probe)
    model = install.patch_saved(make_tiny("llama"), config, 3)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    assert ht.get_config(model) == ht.get_config(reference)
    # a class of its own: another test's patch of a Phi-3 would leave its discovered spec cached for Phi3ForCausalLM
    unseen = type("UnseenPhi3ForCausalLM", (Phi3ForCausalLM,), {})
    phi3 = unseen(Phi3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, pad_token_id=0)).eval()
    with pytest.raises(ValueError, match="UnseenPhi3ForCausalLM has no registry entry and no saved spec"):
        install.patch_saved(phi3, config, 2)
    assert ht.get_config(phi3) is None
