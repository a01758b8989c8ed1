"""The core checks on real pretrained weights: SmolLM2-135M as Llama and as Mistral."""

import subprocess
import sys
import textwrap

import pytest
import torch

import hf_tangent as ht
from hf_tangent.analysis.evaluation import perplexity
from hf_tangent.artifacts.models import load_model
from hf_tangent.training.data import pack_windows

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def windows(smollm2, austen_dir_module):
    text = (austen_dir_module / "emma.txt").read_text(encoding="utf-8")[:20000]
    return pack_windows(smollm2[1], [text], 64, 2)


@pytest.fixture(scope="module")
def austen_dir_module():
    from conftest import AUSTEN

    return AUSTEN


def test_perplexity_matches_the_models_own_loss(smollm2, windows):
    model, _ = smollm2
    result = perplexity(model, windows)
    with torch.no_grad():
        losses = [model(w[None], labels=w[None]).loss.item() for w in windows]
    assert result["nll"] == pytest.approx(sum(losses) / len(losses), rel=1e-6)
    assert result["perplexity"] < 100  # real weights, real English


def test_add_unpatch_and_projection_on_real_weights(smollm2, windows):
    model, _ = smollm2
    with torch.no_grad():
        reference = model(windows).logits
        assert torch.equal(ht.patch(model, ht.TangentConfig())(windows).logits, reference)
        ht.patch(model, ht.TangentConfig(update="projected", layers=[0, 14, 29]))
        layers = model.model.layers
        rec, handles = {}, []
        for k in (0, 14, 29):
            handles.append(layers[k].post_attention_layernorm.register_forward_pre_hook(
                lambda m, a, k=k: rec.__setitem__(("x", k), a[0])))
            handles.append(layers[k].mlp.register_forward_hook(lambda m, a, o, k=k: rec.__setitem__(("y", k), o)))
        projected = model(windows).logits
        for h in handles:
            h.remove()
        for k in (0, 14, 29):
            x, y = rec[("x", k)], rec[("y", k)]
            radial = (x * y).sum(-1).abs() / (x.norm(dim=-1) * y.norm(dim=-1))
            assert radial.max() < 1e-5, k
        assert not torch.equal(projected, reference)
        ht.unpatch(model)
        assert torch.equal(model(windows).logits, reference)


def test_mistral_loading_of_the_same_weights(smollm2, windows):
    llama, _ = smollm2
    mistral, _ = load_model("smollm2-135m-mistral")
    assert type(mistral).__name__ == "MistralForCausalLM"
    config = ht.TangentConfig(update="retract", retraction="cayley", layers=[3, 4])
    with torch.no_grad():
        assert torch.equal(mistral(windows).logits, llama(windows).logits)
        patched_mistral = ht.patch(mistral, config)(windows).logits
        patched_llama = ht.patch(llama, config)(windows).logits
        ht.unpatch(llama)
    assert torch.equal(patched_mistral, patched_llama)


def test_kv_cache_generation_on_real_weights(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer("It is a truth universally acknowledged, that", return_tensors="pt").input_ids
    ht.patch(model, ht.TangentConfig(update="soft", beta=0.25, layers=list(range(0, 30, 3))))
    try:
        with torch.no_grad():
            kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.eos_token_id)
            assert torch.equal(model.generate(ids, use_cache=True, **kwargs), model.generate(ids, use_cache=False, **kwargs))
    finally:
        ht.unpatch(model)


def test_real_weights_save_reload_in_fresh_process_and_bf16(smollm2, windows, tmp_path):
    model, _ = smollm2
    ht.patch(model, ht.TangentConfig(update="norm_preserving", gates=True, layers=[1, 2], parallel_layers=[5]))
    try:
        with torch.no_grad():
            ht.tangent_layers(model)[1].gate.fill_(0.75)
            expected = model(windows).logits
        model.save_pretrained(tmp_path / "m")
    finally:
        ht.unpatch(model)
    torch.save(windows, tmp_path / "w.pt")
    script = textwrap.dedent(f"""
        import torch, hf_tangent as ht
        m = ht.from_pretrained({str(tmp_path / 'm')!r}).eval()
        w = torch.load({str(tmp_path / 'w.pt')!r})
        with torch.no_grad():
            torch.save(m(w).logits, {str(tmp_path / 'out.pt')!r})
            bf16 = ht.from_pretrained({str(tmp_path / 'm')!r}, dtype=torch.bfloat16).eval()
            torch.save(bf16(w).logits.float(), {str(tmp_path / 'bf16.pt')!r})
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert torch.equal(torch.load(tmp_path / "out.pt"), expected)
    bf16 = torch.load(tmp_path / "bf16.pt")
    agree = (bf16.argmax(-1) == expected.argmax(-1)).float().mean()
    assert agree > 0.8
