"""TangentConfig: validation messages, JSON round trip, tolerant loading."""

import json
import math

import pytest

from hf_tangent import TangentConfig

pytestmark = pytest.mark.core


@pytest.mark.parametrize(
    "kwargs, field, accepted",
    [
        (dict(update="tangential"), "update", "'projected'"),
        (dict(update="soft", beta=1.5), "beta", "[0, 1]"),
        (dict(update="soft", beta=-0.1), "beta", "[0, 1]"),
        (dict(update="retract", p=0.0), "p", "> 0"),
        (dict(update="retract", p=float("nan")), "p", "> 0"),
        (dict(update="retract", p=-2), "p", "> 0"),
        (dict(eps=0.0), "eps", "> 0"),
        (dict(eps=float("inf")), "eps", "> 0"),
        (dict(eps_mode="scaled"), "eps_mode", "'relative'"),
        (dict(alpha=float("inf")), "alpha", "finite"),
        (dict(gates="yes"), "gates", "True or False"),
        (dict(layers=[0, 1.5]), "layers", "layer indices"),
        (dict(layers="0,1"), "layers", "layer indices"),
        (dict(parallel_layers=[True]), "parallel_layers", "layer indices"),
        (dict(update="retract", retraction="slerp"), "retraction", "'cayley'"),
        (dict(update="projected", retraction="cayley"), "retraction", "update='retract'"),
    ],
)
def test_bad_values_name_field_value_and_accepted(kwargs, field, accepted):
    with pytest.raises(ValueError) as err:
        TangentConfig(**kwargs)
    message = str(err.value)
    assert f"TangentConfig.{field}=" in message and accepted in message
    assert repr(next(iter(v for k, v in kwargs.items() if k == field))) in message


def test_retraction_alias_sets_p_and_conflicts_are_errors():
    assert TangentConfig(update="retract", retraction="cayley").p == 2.0
    assert math.isinf(TangentConfig(update="retract", retraction="exp").p)
    assert TangentConfig(update="retract", retraction="proj", p=1.0).p == 1.0
    with pytest.raises(ValueError, match="retraction='cayley' means p=2.0, but p=4"):
        TangentConfig(update="retract", retraction="cayley", p=4)


def test_defaults_reproduce_the_unpatched_model():
    assert TangentConfig().is_identity
    assert not TangentConfig(gates=True).is_identity


@pytest.mark.parametrize(
    "config",
    [
        TangentConfig(),
        TangentConfig(update="soft", beta=0.25, layers=[0, -1], gates=True, eps_mode="relative"),
        TangentConfig(update="retract", retraction="exp", alpha=0.5, parallel_layers=[2, 3]),
        TangentConfig(update="retract", p=4.0, eps=1e-5),
    ],
)
def test_json_round_trip(config):
    text = config.to_json_string()
    json.loads(text)  # strict JSON: no Infinity
    assert "Infinity" not in text
    assert TangentConfig.from_json_string(text) == config


def test_unknown_keys_warn_and_are_dropped():
    data = TangentConfig(update="projected").to_dict()
    data["future_knob"] = 3
    with pytest.warns(UserWarning, match="future_knob"):
        config = TangentConfig.from_dict(data)
    assert config == TangentConfig(update="projected")


def test_version_is_recorded():
    from hf_tangent import __version__

    assert TangentConfig().to_dict()["hf_tangent_version"] == __version__


def test_layer_resolution():
    config = TangentConfig(layers=[0, -1, 2])
    assert config.resolve_layers(5) == (0, 2, 4)
    assert TangentConfig().resolve_layers(3) == (0, 1, 2)
    with pytest.raises(ValueError, match=r"layer index 5 is out of range for a model with 5 layers; accepted: -5\.\.4"):
        TangentConfig(layers=[5]).resolve_layers(5)
    with pytest.raises(ValueError, match="names a layer twice"):
        TangentConfig(layers=[1, -4]).resolve_layers(5)
    with pytest.raises(ValueError, match="parallel_layers: layer index -6"):
        TangentConfig(parallel_layers=[-6]).resolve_parallel_layers(5)
