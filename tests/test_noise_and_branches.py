"""Training-time noise updates (math.md section 3) and the attention branch of the rules."""

import math

import pytest
import torch
from conftest import layer_output, make_tiny, spec_of

import hf_tangent as ht
from hf_tangent.core.noise import noise_delta

pytestmark = pytest.mark.core


def _xy(n=4000, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * 5, torch.randn(n, d, generator=g)


def test_noise_is_exactly_off_in_eval_and_on_in_training(ids):
    model = make_tiny("llama")
    with torch.no_grad():
        reference = model(ids).logits
    for update in ("tangent_noise", "gaussian_noise", "residual_dropout"):
        ht.patch(model, ht.TangentConfig(update=update, gamma=1e-2))
        with torch.no_grad():
            assert torch.equal(model.eval()(ids).logits, reference), update
            model.train()
            torch.manual_seed(0)
            noisy = model(ids).logits
            torch.manual_seed(0)
            again = model(ids).logits
            torch.manual_seed(1)
            other = model(ids).logits
        assert not torch.equal(noisy, reference) and torch.equal(noisy, again) and not torch.equal(noisy, other)
        model.eval()
    ht.unpatch(model)


def test_patching_a_model_in_eval_mode_gives_layers_in_eval_mode(ids):
    """A model already in eval mode is patched and run without another .eval(): every noise rule is exactly
    the unpatched model (the new patch modules started in training mode and added noise at inference); a model
    in training mode gets training-mode patches, through ht.patch and ht.update_config alike."""
    model = make_tiny("llama").eval()
    with torch.no_grad():
        reference = model(ids).logits
    for update in ("tangent_noise", "gaussian_noise", "residual_dropout"):
        ht.patch(model, ht.TangentConfig(update=update, gamma=0.5))
        assert not any(m.training for m in model.modules()), update
        with torch.no_grad():
            assert torch.equal(model(ids).logits, reference), update
        ht.update_config(model, gamma=0.25)
        assert not any(m.training for m in model.modules()), update
        ht.unpatch(model)
    model.train()
    ht.patch(model, ht.TangentConfig(update="tangent_noise", gamma=0.5))
    assert all(layer.training for layer in ht.tangent_layers(model))
    ht.unpatch(model)


def test_tangent_noise_is_tangent_and_budgets_match():
    x, y = _xy()
    d, gamma, h = x.shape[-1], 0.03, 0.1
    torch.manual_seed(0)
    tangent = noise_delta(x, y, "tangent_noise", gamma=gamma, h=h) - y
    cos = (x * tangent).sum(-1) / (x.norm(dim=-1) * tangent.norm(dim=-1))
    assert cos.abs().max() < 1e-5  # drift and noise both lie in the tangent space at u
    energy = gamma**2 * h * (d - 1)
    r2 = (x * x).sum(-1)
    torch.manual_seed(0)
    with_noise = noise_delta(x, y, "tangent_noise", gamma=gamma, h=h)
    torch.manual_seed(0)  # the same drift field and draws, without the noise term
    noise_only = with_noise - noise_delta(x, y, "tangent_noise", gamma=0.0, h=h)
    gaussian = noise_delta(x, y, "gaussian_noise", gamma=gamma, h=h) - y
    dropout = noise_delta(x, y, "residual_dropout", gamma=gamma, h=h) - y
    for name, n in (("gaussian", gaussian), ("dropout", dropout)):
        ratio = ((n * n).sum(-1) / r2).mean().item() / energy
        assert ratio == pytest.approx(1.0, rel=0.1), name
    assert ((noise_only * noise_only).sum(-1) / r2).mean().item() / energy == pytest.approx(1.0, rel=0.1)
    assert math.isfinite(cos.abs().max().item())


def test_negative_gamma_and_bad_branches_are_errors():
    with pytest.raises(ValueError, match=r"TangentConfig.gamma=-0.1 is out of range; accepted: a number >= 0 and <= 1000\."):
        ht.TangentConfig(update="tangent_noise", gamma=-0.1)
    with pytest.raises(ValueError, match="TangentConfig.branches=.*'attention'"):
        ht.TangentConfig(branches=("mlp",))


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox_sequential", "llama"])
def test_retraction_on_both_branches_keeps_the_block_norm(arch, ids):
    model = ht.patch(make_tiny(arch), ht.TangentConfig(update="retract", retraction="cayley",
                                                       branches=("ffn", "attention")))
    spec = spec_of(model)
    rec = {}
    layer = spec.decoder_layers(model)[1]
    layer.register_forward_pre_hook(lambda m, a, kw: rec.__setitem__("h", a[0] if a else kw["hidden_states"]),
                                    with_kwargs=True)
    layer.register_forward_hook(lambda m, a, o: rec.__setitem__("out", layer_output(o)))
    with torch.no_grad():
        logits = model(ids).logits
        ffn_only = ht.patch(make_tiny(arch), ht.TangentConfig(update="retract", retraction="cayley"))(ids).logits
    torch.testing.assert_close(rec["out"].norm(dim=-1), rec["h"].norm(dim=-1), rtol=1e-5, atol=0)
    assert not torch.allclose(logits, ffn_only)
