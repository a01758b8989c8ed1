"""Valid values of options, derived from annotations for every door but the shipped core: the *type* an
annotation names (an integer, a number, true/false, a string, a list of them, one of some choices, ...)
and, for numbers, the *range* (`Range`, core/checks.py). A refused value raises checks.py's errors, in the
words its explicit checks use (TangentConfig's; tests/test_config.py compares the two). A number is kept as
a Python int / float (`plain`). Not shipped in a saved folder: hf_tangent.ranges builds the checks of every
recipe function, options dataclass, command and recipe file on it."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import numbers
import os
import types
import typing
from collections.abc import Sequence
from typing import Literal, Union

from .checks import (  # noqa: F401  (re-exported: the names every door imports from here)
    ChoiceError,
    EmptyOptionError,
    OptionTypeError,
    Range,
    RangeError,
    shown,
)


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


def _choices(hint) -> tuple:
    """The values of the Literal(s) in `hint` (through unions)."""
    union = _union_args(hint)
    if union is not None:
        return tuple(c for a in union for c in _choices(a))
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else ()


def _same_kind(value, choice) -> bool:
    """True is not the choice 1, nor 1.0; a str subclass (numpy's str_) is a str."""
    return type(value) is type(choice) or isinstance(value, str) and isinstance(choice, str)


class ListChoiceError(ChoiceError):
    """A list of the right type holding values that are none of the choices (named: `unknown`)."""

    def __init__(self, name: str, value, accepted: str, unknown: list):
        which = "not one" if len(unknown) == 1 else "none"
        self.unknown, self.problem = unknown, f"has {', '.join(map(repr, unknown))}, {which} of the choices"
        super().__init__(name, value, accepted)


def _choice_kind(value, hint) -> bool:
    """Whether `value` has the type of `hint`'s choices (a list: every item that of its item's choices), so that a
    value `hint` refuses is a choice that does not exist, not a value of the wrong type."""
    union = _union_args(hint)
    if union is not None:
        return any(_choice_kind(value, arg) for arg in union)
    item = _sequence_item(hint)
    if item is not None:
        return isinstance(value, (list, tuple)) and bool(value) and all(_choice_kind(v, item) for v in value)
    return any(_same_kind(value, choice) for choice in _choices(hint))


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
        return any(value == arg and _same_kind(value, arg) for arg in typing.get_args(hint))
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
                           ("a string", "strings"), ("true or false", "true or false values"), ("one of", "values among")):
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
    """The value as it is kept: a numpy / other Integral or Real scalar (Fraction) as int / float, so
    that reports, saved configs and torch see plain numbers; a str subclass (numpy's) as a str; a path
    object as its str where a path is meant. The very object when nothing changes."""
    if type(value) in (list, tuple):
        items = [plain(v, hint) for v in value]
        return value if all(a is b for a, b in zip(items, value, strict=True)) else type(value)(items)
    if isinstance(value, bool) or type(value) in (int, float, str) or value is None:
        return value
    if isinstance(value, str):  # the text that was checked: str() of a str enum member is 'U.P', not 'projected'
        return str.__str__(value)
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
            if _choice_kind(value, self.hint):
                if isinstance(value, (list, tuple)):
                    raise ListChoiceError(self.name, value, self.accepted, [v for v in value if not matches([v], self.hint)])
                raise ChoiceError(self.name, value, self.accepted)
            raise OptionTypeError(self.name, value, self.accepted, number=numeric(self.hint))
        many = isinstance(value, (list, tuple)) and listed(self.hint)
        if many and not value and self.nonempty:
            raise EmptyOptionError(self.name, value, self.accepted)
        if self.range is not None and value is not None:
            for item in value if many else [value]:
                if not self.range.accepts(item):
                    raise RangeError(self.name, value, self.accepted)


# ----------------------------------------------------------------------------- owners of options
def hints_of(owner) -> dict:
    try:
        return typing.get_type_hints(owner)
    except (NameError, TypeError) as err:  # never silently unchecked: an option without a readable type
        raise TypeError(f"hf_tangent: the annotations of {getattr(owner, '__qualname__', owner)} do not "
                        f"resolve ({err}); every option needs a type its checks can read.") from err


def build_options(owner, names, ranges: dict, empty: dict, default, shared: dict | None = None) -> dict[str, Option]:
    """The checked options among `names` of a function or dataclass: the type from the annotation, the
    range from `ranges` (else `shared`, for a numeric option); a list option whose default is empty
    takes an empty list as that default, another one only where `empty` says what it means."""
    hints, out = hints_of(owner), {}
    for name in names:
        hint = hints.get(name, typing.Any)
        limit = ranges.get(name, (shared or {}).get(name) if numeric(hint) or hint is typing.Any else None)
        if hint is not typing.Any or limit is not None:
            value = default(name) if listed(hint) else None
            means = empty.get(name, "the default" if isinstance(value, (list, tuple)) and not value else None)
            out[name] = Option(name, hint, limit, means)
    return out


def dataclass_options(cls, shared: dict | None = None) -> dict[str, Option]:
    """The options of an options dataclass: its init fields, ranges in `RANGES`, empty lists in `EMPTY`."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}

    def default(name):
        field = fields[name]
        if field.default is not dataclasses.MISSING:
            return field.default
        return field.default_factory() if field.default_factory is not dataclasses.MISSING else None

    return build_options(cls, fields, getattr(cls, "RANGES", {}), getattr(cls, "EMPTY", {}), default, shared)


def check_fields(obj, options: dict[str, Option], *, prefix: str = "", all_types: bool = True) -> None:
    """Every field of `obj` with an option (`all_types=False`: only those with a range) checked, and
    kept as a plain value (`plain`); `prefix` names the object in errors (`TangentConfig.beta=...`)."""
    for name, option in options.items():
        if all_types or option.range is not None:
            value = getattr(obj, name)
            (dataclasses.replace(option, name=prefix + name) if prefix else option).check(value)
            kept = plain(value, option.hint)
            if kept is not value:
                setattr(obj, name, kept)


own_options = functools.cache(dataclass_options)  # a class that checks itself (TangentConfig): once per class
