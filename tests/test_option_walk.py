"""Issue 32: one validation for every entry. The walk (tests/sweeps/option_walk.py) finds every option of
every public recipe function and options dataclass by introspection and probes it with 0, -1, NaN, +-inf
and a wrong type, through the API, the dataclasses, the command line and recipe files: every probe is
accepted as documented, or refused before any work with one error naming the option, the value and
what is accepted, in the same words through every door."""

from __future__ import annotations

import sys
import typing
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "sweeps"))
import option_walk as walk  # noqa: E402

from hf_tangent.ranges import numeric, options_of  # noqa: E402


def test_every_numeric_option_has_a_range():
    """A new numeric option without a Range (in RANGES or ranges.OPTIONS) fails here."""
    missing = [f"{name}.{o.name}" for name, fn in walk.api_functions().items() for o in options_of(fn).values()
               if numeric(o.hint) and o.range is None]
    missing += [f"{name}.{o.name}" for name, cls in walk.options_dataclasses().items()
                for o in options_of(cls).values() if numeric(o.hint) and o.range is None]
    assert not missing


def test_every_required_parameter_and_command_is_known():
    for name, function in walk.api_functions().items():
        import inspect

        required = [p.name for p in inspect.signature(function).parameters.values()
                    if p.default is inspect.Parameter.empty and p.kind is not p.VAR_KEYWORD]
        assert set(required) <= set(walk.REQUIRED), (name, required)
    assert set(walk.command_parsers()) == set(walk.COMMAND_FUNCTIONS)


def test_the_command_line_and_the_api_say_the_same():
    """An option a command passes to its recipe function accepts the same values, in the same words."""
    functions = walk.api_functions()
    compared = 0
    for command, parser in walk.command_parsers().items():
        target = walk.COMMAND_FUNCTIONS[command]
        if target is None:
            continue
        api = options_of(functions[target])
        for cls in parser.dataclass_types:
            for name, option in options_of(cls).items():
                if name in api and numeric(option.hint):
                    assert option.accepted == api[name].accepted, (command, name)
                    compared += 1
    assert compared >= 40


def test_the_walk_covers_every_door():
    covered = walk.covered()
    counts = {door: len(names) for door, names in covered.items()}
    assert counts["api"] >= 140 and counts["dataclass"] >= 200 and counts["cli"] >= 160, counts
    for name in ("calibrate_gates.eval_batch_size", "parallel_sweep.budget", "heal.max_new_tokens",
                 "run_study.seeds", "calibrate_gates.training_args"):
        assert name in covered["api"], name
    for name in ("TangentTrainingArguments.weight_decay", "TangentTrainingArguments.max_grad_norm",
                 "TangentTrainingArguments.logging_steps", "HealSettings.temperature", "LoraSettings.r",
                 "StudyBudget.learning_rate", "TangentConfig.p"):
        assert name in covered["dataclass"], name


@pytest.mark.parametrize("door", ["api", "dataclass", "cli", "recipe"])
def test_every_probe_is_ok_or_a_clear_error(door, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a wrongly accepted command-line value would write here, never into the tree
    rows = [(case, *case.run()) for case in walk.cases(tmp_path, (door,))]
    failing = [f"{case.name}: {outcome} ({detail})" for case, outcome, detail in rows if outcome not in ("ok", "clear")]
    assert rows
    assert not failing, "\n".join(failing[:40])
    refused = [case for case, outcome, _ in rows if outcome == "clear"]
    assert all(case.refused for case in refused)
    if door in ("cli", "recipe"):
        assert not list(tmp_path.glob("out*")), "a refused value reached the command"


def test_nan_and_inf_are_refused_unless_documented():
    """Non-finite floats: a Range accepts inf only with allow_inf (a note that says what inf means),
    never NaN; the only inf accepted anywhere is TangentConfig.p (the exponential map), whose checks are
    the same Ranges as every other option's."""
    import math

    from hf_tangent.ranges import Range

    assert not Range(0).accepts(math.inf) and not Range(0).accepts(math.nan)
    assert Range(0, allow_inf="no limit").accepts(math.inf) and "inf: no limit" in Range(0, allow_inf="no limit").describe()
    infs = [f"{name}.{o.name}" for name, fn in walk.api_functions().items() for o in options_of(fn).values()
            if o.range is not None and o.range.allow_inf]
    infs += [f"{name}.{o.name}" for name, cls in walk.options_dataclasses().items() for o in options_of(cls).values()
             if o.range is not None and o.range.allow_inf]
    assert infs == ["TangentConfig.p", "TangentPeftConfig.p"]  # the same field (artifacts/adapter)


def test_types_come_from_the_annotations():
    import hf_tangent as ht

    hints = typing.get_type_hints(ht.calibrate_gates)
    assert options_of(ht.calibrate_gates)["training_args"].hint == hints["training_args"]
    with pytest.raises(TypeError, match=r"training_args='fast' has the wrong type \(str\); accepted: a "
                                        r"TangentTrainingArguments, or None\."):
        ht.calibrate_gates(walk.MISSING_MODEL, training_args="fast")


def test_every_public_option_has_an_annotation_and_dtype_one_type():
    """An option without an annotation would not be type-checked (the walk fails on one: only the
    pending ones its owner's file will annotate are let through); every recipe function's dtype takes
    the command line's choices."""
    from hf_tangent.ranges import DType

    assert set(walk.unannotated_options()) <= walk.UNANNOTATED_PENDING
    assert not [case for case in walk.cases(Path("."), ("api",)) if case.run()[0] == "unannotated"]
    dtypes = {name: options_of(fn)["dtype"].hint for name, fn in walk.api_functions().items() if "dtype" in options_of(fn)}
    assert {name for name, hint in dtypes.items() if hint != DType} <= walk.DTYPE_PENDING and len(dtypes) >= 12
