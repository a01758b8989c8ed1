"""TangentConfig: validation messages, JSON round trip, tolerant loading."""

import json
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from conftest import VOCAB, make_tiny

import hf_tangent as ht
from hf_tangent import TangentConfig
from hf_tangent.core.checks import EmptyOptionError
from hf_tangent.ranges import ChoiceError, OptionTypeError, RangeError, options_of, shown

pytestmark = pytest.mark.core


@pytest.mark.parametrize(
    "kwargs, field, error, accepted",
    [
        (dict(update="tangential"), "update", ChoiceError, "'projected'"),
        (dict(update="soft", beta=1.5), "beta", RangeError, "a number >= 0 and <= 1"),
        (dict(update="soft", beta=-0.1), "beta", RangeError, "a number >= 0 and <= 1"),
        (dict(update="retract", p=0.0), "p", RangeError, "a number > 0 (inf: the exponential map"),
        (dict(update="retract", p=float("nan")), "p", RangeError, "a number > 0"),
        (dict(update="retract", p=-2), "p", RangeError, "a number > 0"),
        (dict(eps=0.0), "eps", RangeError, "a number >= 1.17549e-38 and <= 1e+06"),
        (dict(eps=float("inf")), "eps", RangeError, "a number >= 1.17549e-38"),
        (dict(eps_mode="scaled"), "eps_mode", ChoiceError, "'relative'"),
        (dict(alpha=float("inf")), "alpha", RangeError, "a number >= -1e+06 and <= 1e+06"),
        (dict(gates="yes"), "gates", OptionTypeError, "true or false"),
        (dict(layers=[0, 1.5]), "layers", OptionTypeError, "a list of integers, or None"),
        (dict(layers="0,1"), "layers", OptionTypeError, "a list of integers, or None"),
        (dict(parallel_layers=[True]), "parallel_layers", OptionTypeError, "a list of integers"),
        (dict(update="retract", retraction="slerp"), "retraction", ChoiceError, "'cayley'"),
        (dict(alpha=torch.tensor(0.5)), "alpha", OptionTypeError, "a number >= -1e+06"),
        # the explicit checks of the shipped core (core/checks.py) against the words derived from the annotations
        (dict(branches=[]), "branches", EmptyOptionError, "a non-empty list of values among 'ffn', 'attention'"),
        (dict(branches=["ffn", "mlp"]), "branches", OptionTypeError, "a non-empty list of values among"),
        (dict(branches="ffn"), "branches", OptionTypeError, "a non-empty list of values among"),
        (dict(noise_rank=2.0), "noise_rank", OptionTypeError, "an integer >= 1 and <= 65536"),
        (dict(noise_rank=0), "noise_rank", RangeError, "an integer >= 1 and <= 65536"),
        (dict(noise_h=0), "noise_h", RangeError, "a number > 0 and <= 1000"),
        (dict(update="retract", retraction=1), "retraction", OptionTypeError, "one of 'proj', 'cayley', 'exp', or None"),
        (dict(update="retract", p="inf"), "p", OptionTypeError, "a number > 0 (inf: the exponential map"),
        (dict(layers=np.array([0, 1])), "layers", OptionTypeError, "a list of integers, or None"),
        (dict(gates=np.bool_(True)), "gates", OptionTypeError, "true or false"),
        (dict(implementation=None), "implementation", OptionTypeError, "one of 'fused', 'reference', 'triton'"),
    ],
)
def test_bad_values_name_field_value_and_accepted(kwargs, field, error, accepted):
    """TangentConfig's explicit checks (core/checks.py, shipped) give the errors and words that every other
    door derives from the annotations (core/options.py): the recipe functions, the options dataclasses and
    the command line."""
    with pytest.raises(error) as err:
        TangentConfig(**kwargs)
    message = str(err.value)
    assert err.value.name == f"TangentConfig.{field}" and accepted in err.value.accepted
    assert err.value.accepted == options_of(TangentConfig)[field].accepted  # what every door says for this option
    assert message == f"TangentConfig.{field}={shown(kwargs[field])} {err.value.problem}; accepted: {err.value.accepted}."
    assert isinstance(err.value, ValueError) and isinstance(err.value, TypeError) == (error is OptionTypeError)


def test_a_retraction_with_another_update_is_refused():
    with pytest.raises(ValueError, match=r"TangentConfig.retraction='cayley' with update='projected': a retraction is "
                                         r"for update='retract' only; accepted: retraction=None, or update='retract'\."):
        TangentConfig(update="projected", retraction="cayley")


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


# ----------------------------------------------------------------------------- numbers of any kind (issue 46)
EXACT = 2.0**-17  # exactly a float32 too: np.float32(EXACT) is the same number as the float


@pytest.mark.parametrize("field, value, plain", [
    ("alpha", np.float32(0.5), 0.5), ("beta", np.float64(0.25), 0.25), ("eps", np.float32(EXACT), EXACT),
    ("gamma", Fraction(1, 4), 0.25), ("noise_h", Fraction(1, 8), 0.125), ("p", Fraction(3, 2), 1.5),
    ("noise_rank", np.int64(3), 3), ("layers", [np.int64(0), np.int32(-1)], (0, -1)),
])
def test_numbers_of_any_kind_are_kept_as_python_numbers(field, value, plain):
    """A numpy scalar or a Fraction (numbers.Real) is kept as a Python float / int: the saved record is
    JSON (np.float32 was kept as is, and every later save failed: 'Object of type float32 is not JSON
    serializable'); noise_rank=np.int64(3) was refused."""
    config = TangentConfig(update="soft", **{field: value})
    kept = getattr(config, field)
    assert kept == plain and type(kept) is type(plain)
    assert all(type(i) is int for i in kept) if field == "layers" else True
    assert config == TangentConfig(update="soft", **{field: plain})
    assert TangentConfig.from_json_string(config.to_json_string()) == config


@pytest.mark.parametrize("kwargs, implementation", [  # the sweep's `numbers` group runs the other pairs
    (dict(update="soft", beta=Fraction(1, 2), alpha=np.float32(0.5), eps=np.float32(EXACT)), "reference"),
    (dict(update="retract", p=Fraction(3, 2), eps_mode="relative", eps=Fraction(1, 1024)), "fused"),
])
def test_a_patch_of_numpy_and_fraction_numbers_runs_saves_and_equals_the_float_one(kwargs, implementation, tmp_path):
    """The rules see plain floats: 20 rows through the reference rules failed with a Fraction ('unsupported
    operand type(s) for *: 'Fraction' and 'Tensor''), and save_pretrained failed with a numpy scalar."""
    plain = {k: float(v) if not isinstance(v, str) else v for k, v in kwargs.items()}
    ids = torch.randint(0, VOCAB, (20, 6), generator=torch.Generator().manual_seed(0))
    model = ht.patch(make_tiny("llama"), TangentConfig(implementation=implementation, **kwargs))
    reference = ht.patch(make_tiny("llama"), TangentConfig(implementation=implementation, **plain))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    ht.update_config(model, alpha=np.float32(0.25))
    assert type(ht.get_config(model).alpha) is float and ht.get_config(model).alpha == 0.25
    model.save_pretrained(tmp_path / "saved")
    again = ht.from_pretrained(tmp_path / "saved")
    assert ht.get_config(again) == ht.get_config(model)


def test_a_0_dim_tensor_is_refused_by_name():
    """A 0-dim tensor or array is not a number (it may carry a device and a graph): refused by its type,
    with what to pass instead, through TangentConfig as through update_config."""
    for value in (torch.tensor(0.5), np.array(0.5)):
        with pytest.raises(OptionTypeError, match=rf"TangentConfig.alpha=.* has the wrong type \({type(value).__name__}, "
                                                  r"0-dim: pass \.item\(\)\); accepted: a number >= -1e\+06"):
            TangentConfig(alpha=value)
    model = ht.patch(make_tiny("llama"), TangentConfig(update="projected"))
    with pytest.raises(OptionTypeError, match=r"has the wrong type \(Tensor, 0-dim: pass \.item\(\)\)"):
        ht.update_config(model, alpha=torch.tensor(0.5))
    assert ht.get_config(model).alpha == 1.0


@pytest.mark.parametrize("p", ["1e400", " 2.0 ", "Infinity", "2"])
def test_a_saved_p_is_a_number_or_the_inf_that_to_dict_writes(p):
    """from_dict converted any string p with float(): a hand-edited record's "1e400" loaded as the exponential
    map and " 2.0 " as Cayley. Only "inf", what to_dict writes for the exponential map, is read as a number."""
    with pytest.raises(ValueError, match=r"TangentConfig\.p=.* has the wrong type \(str\); accepted: a number > 0"):
        TangentConfig.from_dict({"update": "retract", "p": p})
    saved = TangentConfig(update="retract", retraction="exp").to_dict()
    assert saved["p"] == "inf" and math.isinf(TangentConfig.from_dict(saved).p)


def test_noise_rank_has_an_upper_bound():
    """noise_rank=2**63 was accepted and the first training forward failed inside torch.randn (overflow)."""
    with pytest.raises(ValueError, match=r"TangentConfig\.noise_rank=9223372036854775808 is out of range; accepted: an "
                                         r"integer >= 1 and <= 65536"):
        TangentConfig(update="tangent_noise", noise_rank=2**63)
    assert TangentConfig(update="tangent_noise", noise_rank=2**16).noise_rank == 2**16


def test_a_str_subclass_is_checked_by_its_text_not_its_own_equality():
    """A str subclass whose __eq__ ignores case passed the choice and was stored as its own text ('ADD'); with
    retraction it then raised a bare KeyError. The choice compares the text itself."""
    class Caseless(str):
        def __eq__(self, other):
            return isinstance(other, str) and self.lower() == other.lower()

        __hash__ = str.__hash__

    with pytest.raises(ChoiceError, match=r"TangentConfig.update='ADD' is not one of the choices"):
        TangentConfig(update=Caseless("ADD"))
    with pytest.raises(ChoiceError, match=r"TangentConfig.retraction='Cayley' is not one of the choices"):
        TangentConfig(update="retract", retraction=Caseless("Cayley"))
    with pytest.raises(OptionTypeError, match=r"TangentConfig.branches="):
        TangentConfig(branches=[Caseless("FFN")])
    assert type(TangentConfig(update=Caseless("add")).update) is str
