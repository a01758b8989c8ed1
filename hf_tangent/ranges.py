"""Valid values of options, declared once and checked in one place, for every door.

The check itself is `core/options.py` (the type from an annotation, `Range`, the errors and their
words), which TangentConfig uses too; this module applies it to the recipe functions, the options
dataclasses, the command line and recipe files:

* A recipe function (`ht.evaluate_rules`, ...) is decorated with `@validated(RANGES)`: every argument
  is checked before the function runs, so before any model is loaded or touched.
* An options dataclass (a command's arguments, TangentTrainingArguments, HealSettings, LoraSettings)
  lists its ranges in `RANGES` and calls `check_ranges(self)` in `__post_init__`; the command line
  and recipe YAML files build these dataclasses, so they refuse the same values with the same words.
* Options that mean the same thing everywhere (seq_len, batch_size, seed, ...) take their range from
  `OPTIONS`, so `batch_size=0` gives the same answer through every door.

A refused value raises `RangeError` (a ValueError; `OptionTypeError`, a RangeError that is also a
TypeError, for a value of the wrong type) naming the option, the value and what is accepted. A number
given as a numpy scalar or a Fraction is kept as a Python int / float.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
from typing import Literal

from .core.options import (  # noqa: F401  (the names every caller imports from here)
    ChoiceError,
    Option,
    OptionTypeError,
    ProgressBar,
    Range,
    RangeError,
    build_options,
    check_fields,
    dataclass_options,
    hints_of,
    listed,
    matches,
    numeric,
    plain,
    shown,
)


def at_least(low, integer: bool = True) -> Range:
    return Range(low=low, integer=integer)


SEED = Range(0, 2**32 - 1, integer=True)  # numpy's seeds: 0 .. 2**32 - 1

# Options that mean the same everywhere: one range, whichever function or dataclass takes them.
OPTIONS: dict[str, Range] = {
    "seq_len": at_least(2), "max_windows": at_least(1), "batch_size": at_least(1), "train_windows": at_least(1),
    "eval_batch_size": at_least(1), "bootstrap": at_least(1), "seed": SEED, "seeds": SEED, "random_seeds": SEED,
    "layers": Range(integer=True),  # layer indices; negative counts from the end where a patch takes them
    "parallel_layers": Range(integer=True),
}
# the ranges of the options every analysis shares (kept for the callers that name them)
TEXT_RANGES = {k: OPTIONS[k] for k in ("seq_len", "max_windows", "batch_size")}
# analyses that report per layer take indices 0 .. L-1 (checked against the model once it is loaded)
LAYER_INDICES = Range(0, integer=True)

DType = Literal["float32", "bfloat16", "float16"]  # the weights' dtype of a model loaded by name, every door


def check_values(ranges: dict[str, Range], **values) -> None:
    """Every value of the right type (an int for an integer range, else a number: a list is never
    one) and within its range; None means 'not set'."""
    for name, value in values.items():
        if value is not None and name in ranges:
            Option(name, int if ranges[name].integer else float, ranges[name]).check(value)


# ----------------------------------------------------------------------------- functions
def validated(ranges: dict[str, Range] | None = None, *, empty: dict[str, str] | None = None):
    """Decorator of a public function: every argument given is checked against its annotation and
    its range (`OPTIONS`, then `ranges`) before the function runs; a refused value raises RangeError.
    A list option refuses an empty list unless its default is empty or `empty` says what one means.
    An options object given (TangentTrainingArguments, HealSettings, ...: a class with RANGES) is
    checked again, field by field: it may have been changed since it was made.
    Numpy scalars reach the function as int / float, path objects as str where a path is meant.
    `options_of(function)` lists what is checked."""

    def wrap(function):
        signature = inspect.signature(function)

        @functools.wraps(function)
        def run(*args, **kwargs):
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError as err:
                raise TypeError(f"{function.__name__}: {err}") from None
            options = options_of(run)
            for name, value in bound.arguments.items():
                if name in options:
                    value = meant(value)
                    options[name].check(value)
                    if _has_ranges(value):
                        check_ranges(value, prefix=f"{name}.")
                    bound.arguments[name] = plain(value, options[name].hint)
            return function(*bound.args, **bound.kwargs)

        run.__ranges__ = dict(ranges or {})
        run.__empty__ = dict(empty or {})
        return run

    return wrap


def _has_ranges(value) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type) and isinstance(getattr(value, "RANGES", None), dict)


def _parameters(function) -> list[str]:
    return [n for n, p in inspect.signature(function).parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


@functools.cache
def options_of(owner) -> dict[str, Option]:
    """The checked options of a `validated` function or an options dataclass, by name (a dataclass made from a
    function's parameters, `__options_of__`: the function's, so that both refuse a value in the same words)."""
    source = getattr(owner, "__options_of__", None)
    if source is not None:
        return {f.name: options_of(source)[f.name] for f in dataclasses.fields(owner)}
    if dataclasses.is_dataclass(owner):
        return dataclass_options(owner, OPTIONS)
    parameters = inspect.signature(owner).parameters
    return build_options(owner, _parameters(owner), getattr(owner, "__ranges__", {}), getattr(owner, "__empty__", {}),
                         lambda name: parameters[name].default, OPTIONS)


def check_ranges(options, *, all_types: bool | None = None, prefix: str = "") -> None:
    """Every field of an options dataclass against its type and its range (RANGES, else OPTIONS), each
    number kept as a Python int / float. `all_types=False` (default: the class's RANGES_ALL_TYPES, else
    True): only the fields that have a range are checked (a class whose other fields another library
    converts, like transformers' TrainingArguments). `prefix` names the object in errors
    (`training_args.learning_rate=nan ...`)."""
    if all_types is None:
        all_types = getattr(type(options), "RANGES_ALL_TYPES", True)
    for name, option in options_of(type(options)).items():
        if all_types or option.range is not None:
            value = getattr(options, name)
            if meant(value) is not value:
                setattr(options, name, meant(value))
    check_fields(options, options_of(type(options)), prefix=prefix, all_types=all_types)


def meant(value):
    """An enum member as its value, in a list too (`plain` would keep str(U.P), 'U.P', of a str enum member,
    which passed the check as 'projected'); the very object when nothing changes."""
    if isinstance(value, enum.Enum):
        return value.value
    if type(value) in (list, tuple):
        items = [meant(v) for v in value]
        return value if all(a is b for a, b in zip(items, value, strict=True)) else type(value)(items)
    return value
