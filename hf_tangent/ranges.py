"""Valid values of options, declared once and checked in one place, for every door.

An option is checked twice over: its *type* (from the annotation of the function parameter or
dataclass field: an integer, a number, true/false, a string, a list of them, a TrainingArguments,
...) and, for numbers, its *range* (`Range`). A `Range` never accepts NaN, nor +-inf unless it says
what inf means (`allow_inf`).

* A recipe function (`ht.evaluate_rules`, ...) is decorated with `@validated(RANGES)`: every argument
  is checked before the function runs, so before any model is loaded or touched.
* An options dataclass (a command's arguments, TangentTrainingArguments, HealSettings, LoraSettings)
  lists its ranges in `RANGES` and calls `check_ranges(self)` in `__post_init__`; the command line
  and recipe YAML files build these dataclasses, so they refuse the same values with the same words.
* Options that mean the same thing everywhere (seq_len, batch_size, seed, ...) take their range from
  `OPTIONS`, so `batch_size=0` gives the same answer through every door.

A refused value raises `RangeError` (a ValueError; `OptionTypeError`, a RangeError that is also a
TypeError, for a value of the wrong type) naming the option, the value and what is accepted.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
import os
import types
import typing
from collections.abc import Sequence
from typing import Literal, Union


@dataclasses.dataclass(frozen=True)
class Range:
    """low <= value <= high (`open_low` / `open_high`: strict); None: unbounded. `integer`: an int.
    NaN is never accepted; +-inf only with `allow_inf`, a note that says what inf means."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    integer: bool = False
    allow_inf: str | None = None

    def accepts(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return False
        if isinstance(value, numbers.Integral):  # exact, however large: no float conversion (10**400)
            value = int(value)
            if not self.integer and not _fits_float(value):
                return False  # a number option: an int beyond float range is no finite number
        else:
            if math.isnan(value) or (math.isinf(value) and not self.allow_inf):
                return False
            if self.integer:
                return False
        if self.low is not None and (value <= self.low if self.open_low else value < self.low):
            return False
        return not (self.high is not None and (value >= self.high if self.open_high else value > self.high))

    def describe(self) -> str:
        bounded = self.low is not None and self.high is not None
        kind = "an integer" if self.integer else "a number" if bounded or self.allow_inf else "a finite number"
        low = None if self.low is None else f"{'>' if self.open_low else '>='} {_number(self.low)}"
        high = None if self.high is None else f"{'<' if self.open_high else '<='} {_number(self.high)}"
        text = " and ".join([f"{kind} {low or high or ''}".strip()] + ([high] if low and high else []))
        return f"{text} (inf: {self.allow_inf})" if self.allow_inf else text


def _fits_float(value: int) -> bool:
    try:
        float(value)
    except OverflowError:
        return False
    return True


def _number(x) -> str:
    return str(int(x)) if isinstance(x, int) else f"{x:g}"


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


class RangeError(ValueError):
    """A value outside its option's range; `name`, `value` and `accepted` for the caller's wording."""

    problem = "is out of range"

    def __init__(self, name: str, value, accepted: str):
        self.name, self.value, self.accepted = name, value, accepted
        super().__init__(f"{name}={shown(value)} {self.problem}; accepted: {accepted}.")

    def as_option(self) -> str:
        """The same error in command-line words: `--seq-len 1 is out of range; accepted: ...`."""
        word = lambda v: shown(v) if isinstance(v, int) else str(v)  # noqa: E731  (10**400 by its size)
        value = " ".join(map(word, self.value)) or "[]" if isinstance(self.value, (list, tuple)) else word(self.value)
        return f"--{self.name.replace('_', '-')} {value} {self.problem}; accepted: {self.accepted}."


def shown(value) -> str:
    """A value as an error names it: its repr, or for an object with a long repr (a whole
    TrainingArguments) its type only."""
    text = repr(value)
    if isinstance(value, int) and len(text) > 40:  # 10**400: its size, not its digits
        return f"{text[:12]}...({len(text.lstrip('-'))} digits)"
    return text if len(text) <= 120 and "\n" not in text else f"<{type(value).__name__} object>"


class OptionTypeError(RangeError, TypeError):
    """A value of the wrong type for its option (a string for a number, a float for an integer, ...)."""

    def __init__(self, name: str, value, accepted: str):
        self.problem = f"has the wrong type ({type(value).__name__})"
        super().__init__(name, value, accepted)


class ChoiceError(RangeError):
    """A value of the right type that is none of the option's choices (dtype="float64")."""

    problem = "is not one of the choices"


def _choices(hint) -> tuple:
    """The values of the Literal(s) in `hint` (through unions)."""
    union = _union_args(hint)
    if union is not None:
        return tuple(c for a in union for c in _choices(a))
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else ()


class EmptyOptionError(RangeError):
    """An empty list for an option where an empty list means nothing (seeds=[], variants=[], ...)."""

    problem = "is empty"


DType = Literal["float32", "bfloat16", "float16"]  # the weights' dtype of a model loaded by name, every door


@typing.runtime_checkable
class ProgressBar(typing.Protocol):
    """A progress bar an entry updates as it goes: anything with `update(n)` (a tqdm bar)."""

    def update(self, n=1): ...


# ----------------------------------------------------------------------------- types
_NONE = type(None)


def _union_args(hint) -> tuple | None:
    return typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else None


def _sequence_item(hint):
    """X of list[X] / tuple[X, ...] / Sequence[X]; None for anything else."""
    origin = typing.get_origin(hint)
    if origin in (list, tuple, Sequence) or hint in (list, tuple):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return args[0] if args else typing.Any
    return None


def matches(value, hint) -> bool:
    """Whether `value` has the type `hint` says (unknown hints accept anything). A bool is not a
    number, a str is not a list, an int is a float."""
    if hint is typing.Any or isinstance(hint, (str, typing.TypeVar)):
        return True
    if hint is _NONE or hint is None:
        return value is None
    union = _union_args(hint)
    if union is not None:
        return any(matches(value, arg) for arg in union)
    if typing.get_origin(hint) is Literal:
        return any(value == arg and type(value) is type(arg) for arg in typing.get_args(hint))
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    item = _sequence_item(hint)
    if item is not None:
        return isinstance(value, (list, tuple)) and all(matches(v, item) for v in value)
    origin = typing.get_origin(hint) or hint
    if isinstance(origin, type):
        return isinstance(value, origin)
    return True


def _plural(text: str) -> str:
    for single, plural in (("an integer", "integers"), ("a finite number", "finite numbers"), ("a number", "numbers"),
                           ("a string", "strings"), ("true or false", "true or false values")):
        if text.startswith(single):
            return plural + text[len(single):]
    return text


def describe_type(hint, range: Range | None = None, nonempty: bool = False) -> str:
    """What an option of type `hint` (and `range`) accepts, in words: `an integer >= 1, or None`."""
    union = _union_args(hint)
    if union is not None:
        parts = [describe_type(a, range, nonempty) for a in union if a is not _NONE]
        return " or ".join(parts) + (", or None" if _NONE in union else "")
    if hint is _NONE or hint is None:
        return "None"
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if hint in (int, float) or (range is not None and hint in (typing.Any, inspect.Parameter.empty)):
        return range.describe() if range is not None else ("an integer" if hint is int else "a finite number")
    if hint is bool:
        return "true or false"
    if hint is str:
        return "a string"
    if hint is os.PathLike:
        return "a path"
    if hint is ProgressBar:
        return "a progress bar (an object with update(n), like tqdm)"
    item = _sequence_item(hint)
    if item is not None:
        return ("a non-empty list of " if nonempty else "a list of ") + _plural(describe_type(item, range))
    origin = typing.get_origin(hint) or hint
    if origin is dict:
        return "a mapping"
    return f"a {getattr(origin, '__name__', str(origin))}"


def numeric(hint) -> bool:
    """Whether an option of type `hint` holds numbers (int, float, a list of them, or None)."""
    union = _union_args(hint)
    if union is not None:
        return any(numeric(a) for a in union if a is not _NONE)
    item = _sequence_item(hint)
    return numeric(item) if item is not None else hint in (int, float)


def listed(hint) -> bool:
    """Whether an option of type `hint` takes a list (list[X], tuple[X, ...], or such | None)."""
    union = _union_args(hint)
    if union is not None:
        return any(listed(a) for a in union)
    return _sequence_item(hint) is not None


def plain(value, hint):
    """The value as the function should see it: a numpy / other Integral or Real scalar as int /
    float (so reports store plain numbers), a path object as its str where a path is meant."""
    if type(value) in (list, tuple):
        return type(value)(plain(v, hint) for v in value)
    if isinstance(value, bool) or type(value) in (int, float, str) or value is None:
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real) and numeric(hint):
        return float(value)
    if isinstance(value, os.PathLike) and matches("path", hint):
        return os.fspath(value)
    return value


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of a function or dataclass: its type (the annotation), its range (numbers) and,
    for a list, what an empty one means (`empty`; None: an empty list is refused)."""

    name: str
    hint: typing.Any
    range: Range | None = None
    empty: str | None = "accepted"

    @property
    def nonempty(self) -> bool:
        return listed(self.hint) and self.empty is None

    @property
    def accepted(self) -> str:
        return describe_type(self.hint, self.range, self.nonempty)

    def check(self, value, check_type: bool = True) -> None:
        if check_type and not matches(value, self.hint):
            if any(type(choice) is type(value) for choice in _choices(self.hint)):
                raise ChoiceError(self.name, value, self.accepted)
            raise OptionTypeError(self.name, value, self.accepted)
        many = isinstance(value, (list, tuple)) and listed(self.hint)
        if many and not value and self.nonempty:
            raise EmptyOptionError(self.name, value, self.accepted)
        if self.range is not None and value is not None:
            for item in value if many else [value]:
                if not self.range.accepts(item):
                    raise RangeError(self.name, value, self.accepted)


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


def _hints(owner) -> dict:
    try:
        return typing.get_type_hints(owner)
    except (NameError, TypeError) as err:  # never silently unchecked: an option without a readable type
        raise TypeError(f"hf_tangent.ranges: the annotations of {getattr(owner, '__qualname__', owner)} do not "
                        f"resolve ({err}); every option needs a type its checks can read.") from err


def unannotated(owner) -> list[str]:
    """The options of a function or dataclass with no annotation (so no type check): the option walk
    fails on any."""
    hints = _hints(owner)
    if dataclasses.is_dataclass(owner):
        return [f.name for f in dataclasses.fields(owner) if f.init and f.name not in hints]
    return [n for n, p in inspect.signature(owner).parameters.items()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n not in hints]


def _default(owner, name):
    if dataclasses.is_dataclass(owner):
        field = next(f for f in dataclasses.fields(owner) if f.name == name)
        if field.default is not dataclasses.MISSING:
            return field.default
        return field.default_factory() if field.default_factory is not dataclasses.MISSING else None
    return inspect.signature(owner).parameters[name].default


@functools.cache
def options_of(owner) -> dict[str, Option]:
    """The checked options of a `validated` function or an options dataclass, by name."""
    hints = _hints(owner)
    if dataclasses.is_dataclass(owner):
        ranges, empty = getattr(owner, "RANGES", {}), getattr(owner, "EMPTY", {})
        names = [f.name for f in dataclasses.fields(owner) if f.init]
    else:
        ranges, empty = getattr(owner, "__ranges__", {}), getattr(owner, "__empty__", {})
        names = [n for n, p in inspect.signature(owner).parameters.items()
                 if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    out = {}
    for name in names:
        hint = hints.get(name, typing.Any)
        limit = ranges.get(name, OPTIONS.get(name) if numeric(hint) or hint is typing.Any else None)
        if hint is not typing.Any or limit is not None:
            default = _default(owner, name) if listed(hint) else None
            means = empty.get(name, "the default" if isinstance(default, (list, tuple)) and not default else None)
            out[name] = Option(name, hint, limit, means)
    return out


def check_ranges(options, *, all_types: bool | None = None, prefix: str = "") -> None:
    """Every field of an options dataclass against its type and its range (RANGES, else OPTIONS).
    `all_types=False` (default: the class's RANGES_ALL_TYPES, else True): only the fields that have a
    range are checked (a class whose other fields another library converts, like transformers'
    TrainingArguments). `prefix` names the object in errors (`training_args.learning_rate=nan ...`)."""
    if all_types is None:
        all_types = getattr(type(options), "RANGES_ALL_TYPES", True)
    for name, option in options_of(type(options)).items():
        if all_types or option.range is not None:
            if prefix:
                option = dataclasses.replace(option, name=prefix + name)
            option.check(getattr(options, name))
