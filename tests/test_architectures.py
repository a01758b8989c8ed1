"""Discovery and verification (discovery.py), and the coverage of transformers' causal-LM types.

The coverage walk itself lives in tests/architectures.py (it writes docs/architectures.md). CI runs
it on one representative type per kind of block; the whole mapping is the `slow` test below.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hf_tangent as ht
from hf_tangent.core import discovery, registry

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
import architectures  # noqa: E402
from conftest import logits_without_hf_tangent  # noqa: E402

# one type per kind of block: pre-norm, sandwich, post-FFN norm only, parallel, residual-scaled, MoE,
# MLA + MoE, hybrid with per-class roles, FFN split over fc1/fc2 (OPT), FFN inside the MLP's own add (Bloom),
# and refusals: post-LN, SSM without an FFN, residual scaled as alpha * r
REPRESENTATIVE = ["llama", "gemma3_text", "olmo2", "gptj", "phi", "granite", "mixtral", "deepseek_v3", "olmo_hybrid",
                  "opt", "bloom", "gpt_bigcode", "cohere", "bert", "mamba", "doge"]
MUST_REFUSE = {"bert", "mamba", "doge"}


@pytest.fixture(autouse=True)
def _fresh_caches():
    discovery._VERIFIED.clear()
    registry._DISCOVERED.clear()
    yield


@pytest.mark.parametrize("model_type", REPRESENTATIVE)
def test_representative_types_verify_against_the_weights(model_type):
    row = architectures.check_type(model_type)
    if model_type in MUST_REFUSE:
        assert row["support"] == "refused" and not row["verified"], row
    else:
        assert row["verified"], row


@pytest.mark.slow
def test_whole_mapping_coverage(tmp_path):
    rows = [architectures.check_type(t) for t in architectures.causal_lm_types()]
    accepted_wrong = [r for r in rows if r["support"] in ("registry", "discovered") and not r["verified"]]
    assert not accepted_wrong, accepted_wrong  # 0 types accepted whose update lands in the wrong place
    # the kept coverage table (docs/architectures.md) is what the walk gives now, type by type
    kept = (Path(__file__).resolve().parents[1] / "docs" / "architectures.md").read_text(encoding="utf-8")
    assert architectures.table(rows) == kept


def test_llama_names_on_gemma3_are_refused():
    """The trap: gemma3 has all four Llama child names; a Llama spec would add the update to the
    attention output's norm. Verification refuses it and names the failed check."""
    model = architectures.build("gemma3_text")
    llama = discovery.get_spec("llama")
    discovery.register_architecture(dataclasses.replace(llama, model_type="gemma3_text"))
    try:
        with pytest.raises(ValueError, match=r"'gemma3_text'.*did not verify: in layer 0, out != r \+ s \* ffn_out"
                                             r".*post_attention_layernorm.*register_architecture"):
            ht.patch(model, ht.TangentConfig(update="projected"))
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    finally:
        registry._REGISTRY.pop("gemma3_text")


def test_sandwich_spec_and_math():
    """Gemma 3: x = the pre-FFN norm's input, y = post_norm(mlp(pre_norm(x))), the post-norm's output."""
    model = architectures.build("gemma3_text")
    spec = discovery.resolve_spec(model)
    assert (spec.ffn_norm, spec.mlp, spec.ffn_out) == ("pre_feedforward_layernorm", "mlp", "post_feedforward_layernorm")
    assert (spec.attention, spec.attention_out) == ("self_attn", "post_attention_layernorm")
    layer = spec.decoder_layers(model)[0]
    seen = {}
    layer.pre_feedforward_layernorm.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0].double()))
    layer.post_feedforward_layernorm.register_forward_hook(lambda m, a, o: seen.__setitem__("y", o.double()))
    layer.register_forward_hook(lambda m, a, o: seen.__setitem__("out", (o[0] if isinstance(o, tuple) else o).double()))
    ids = architectures.PROBE_IDS
    with torch.no_grad():
        model(ids, use_cache=False)
    x, y, out = seen["x"], seen["y"], seen["out"]
    assert torch.allclose(out, x + y, atol=1e-5)
    ht.patch(model, ht.TangentConfig(update="projected", layers=[0], eps=1e-12, eps_mode="relative"))
    with torch.no_grad():
        model(ids, use_cache=False)
    expected = x + y - (x * y).sum(-1, keepdim=True) / (x * x).sum(-1, keepdim=True) * x
    assert torch.allclose(seen["out"], expected, atol=1e-5)


def test_residual_multiplier_is_found_and_applied():
    model = architectures.build("granite")  # residual_multiplier 0.5 in the tiny config
    spec = discovery.resolve_spec(model)
    assert spec.residual_scale == "residual_multiplier" and model.model.layers[0].residual_multiplier == 0.5
    row = architectures.check_type("granite")
    assert row["verified"], row


def test_parallel_roles_are_not_swapped():
    """out = h + a + f is symmetric in a and f: the FFN is the branch that acts on each token alone."""
    model = architectures.build("gptj")
    spec = discovery.resolve_spec(model)
    assert (spec.attention, spec.mlp, spec.parallel) == ("attn", "mlp", True)
    swapped = dataclasses.replace(spec, attention="mlp", mlp="attn")
    layers = spec.decoder_layers(model)
    with pytest.raises(ValueError, match="attention and FFN roles are swapped"):
        discovery.require_verified(model, swapped, layers, needs_attention=[])


def test_dropout_after_the_ffn_is_exact_in_eval_only():
    from transformers import OPTConfig, OPTForCausalLM

    model = OPTForCausalLM(OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                     num_attention_heads=4, max_position_embeddings=64, dropout=0.1)).eval()
    ht.patch(model, ht.TangentConfig(update="projected"))
    assert "eval mode only" in ht.describe(model)
    model(architectures.PROBE_IDS)  # eval: fine
    model.train()
    with pytest.raises(RuntimeError, match="dropout after the module whose output it adds.*eval mode only"):
        model(architectures.PROBE_IDS)
    model2 = OPTForCausalLM(OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                      num_attention_heads=4, max_position_embeddings=64, dropout=0.0)).train()
    ht.patch(model2, ht.TangentConfig(update="projected"))
    model2(architectures.PROBE_IDS)  # no dropout: exact in training too


def test_describe_and_refusal_messages():
    model = architectures.build("olmo_hybrid")
    text = ht.describe(model)
    assert "discovered spec" in text and "OlmoHybridAttentionDecoderLayer=" in text and "FFN update verified" in text
    mamba = architectures.build("mamba")
    with pytest.raises(ValueError, match=r"'mamba' has no registry entry and discovery failed.*register_architecture"):
        ht.patch(mamba, ht.TangentConfig(update="projected"))


def test_discovered_model_round_trips_in_a_fresh_process(tmp_path):
    model = architectures.build("gemma3_text")
    ht.patch(model, ht.TangentConfig(update="retract", p=2.0, gates=True))
    with torch.no_grad():
        ht.tangent_layers(model)[1].gate.fill_(0.5)
        expected = model(architectures.PROBE_IDS, use_cache=False).logits
    ht.save_pretrained(model, tmp_path / "m")
    torch.save(expected, tmp_path / "expected.pt")
    script = textwrap.dedent(f"""
        import torch, hf_tangent as ht
        from transformers import AutoModelForCausalLM
        ids = torch.tensor({architectures.PROBE_IDS.tolist()})
        model = ht.from_pretrained({str(tmp_path / 'm')!r}).eval()
        assert ht.get_config(model).update == "retract"
        assert model.config.hf_tangent["architecture"]["source"] == "discovered"
        with torch.no_grad():
            got = model(ids, use_cache=False).logits
        assert torch.equal(got, torch.load({str(tmp_path / 'expected.pt')!r})), (got - torch.load({str(tmp_path / 'expected.pt')!r})).abs().max()
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


def test_hub_folder_of_a_discovered_model_loads_without_hf_tangent(tmp_path):
    """The remote code finds the discovered spec in the saved record (the weights are on the meta
    device inside from_pretrained, so it cannot probe)."""
    model = architectures.build("olmo2")
    ht.patch(model, ht.TangentConfig(update="soft", beta=0.5, gates=True))
    with torch.no_grad():
        ht.tangent_layers(model)[0].gate.fill_(0.7)
        expected = model(architectures.PROBE_IDS).logits
    ht.save_hub_folder(model, tmp_path / "hub")
    assert torch.equal(logits_without_hf_tangent(tmp_path / "hub", architectures.PROBE_IDS, tmp_path), expected)


def test_hand_registered_residual_scale_is_verified():
    """A residual-scaled architecture registered by hand verifies with its residual_scale and is
    refused without it (s = 0.5 is not 1: the update would land scaled)."""
    model = architectures.build("granite")
    names = dict(layers="model.layers", input_norm="input_layernorm", attention="self_attn",
                 ffn_norm="post_attention_layernorm", mlp="mlp")
    discovery.register_architecture(model_type="granite", residual_scale="residual_multiplier", **names)
    try:
        ht.patch(model, ht.TangentConfig(update="projected"))
        assert ht.get_config(model) is not None
        ht.unpatch(model)
        discovery.register_architecture(model_type="granite", overwrite=True, **names)
        discovery._VERIFIED.clear()
        with pytest.raises(ValueError, match=r"did not verify: in layer 0, out != r \+ s \* ffn_out.*\(s = 1\)"):
            ht.patch(model, ht.TangentConfig(update="projected"))
    finally:
        registry._REGISTRY.pop("granite")


def test_analysis_of_an_unpatched_discovered_type():
    """The analysis tools resolve an unregistered type the way patch does (hf-tangent ablate on
    gemma3-270m used to stop at 'model_type is not supported')."""
    from hf_tangent.analysis.ablation import run_ablation

    model = architectures.build("gemma3_text")
    windows = architectures.PROBE_IDS.repeat(2, 1)
    result = run_ablation(model, windows, layerwise=True, variants=("full", "zero_ffn"))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())

    def loss(zeroed_layers):  # independent: the sandwich FFN's output (post-FFN norm) zeroed by plain hooks
        handles = [model.model.layers[i].post_feedforward_layernorm.register_forward_hook(
            lambda m, a, o: torch.zeros_like(o)) for i in zeroed_layers]
        with torch.no_grad():
            value = model(windows, labels=windows).loss.item()
        for h in handles:
            h.remove()
        return value

    layers = range(len(model.model.layers))
    rows = {(r["variant"], r["layer"]): r for r in result["rows"]}
    assert result["full_loss"] == pytest.approx(loss([]), rel=1e-5)
    assert rows[("zero_ffn", "all")]["loss"] == pytest.approx(loss(layers), rel=1e-5)
    for i in layers:
        assert rows[("zero_ffn", i)]["increase"] == pytest.approx(loss([i]) - loss([]), abs=1e-5)


@pytest.mark.parametrize("model_type, reason", [
    ("bart", "post-LN block: out = norm\\(r \\+ ffn"),
    ("mamba", "no sub-block that adds to its residual acts on each token alone"),
])
def test_refusals_say_why(model_type, reason):
    model = architectures.build(model_type)
    with pytest.raises(ValueError, match=f"discovery failed.*{reason}"):
        ht.patch(model, ht.TangentConfig(update="projected"))
