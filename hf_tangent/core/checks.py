"""A number's `Range`, the errors of a refused value, and the few checks the shipped core makes with them.

A refused value raises `RangeError` (a ValueError; `OptionTypeError`, also a TypeError, for the wrong
type) naming the option, the value and what is accepted. A number is any `numbers.Real` but bool (numpy
scalars, `Fraction`), kept as a Python int / float; a 0-dim tensor or array is not one. Standard library
only: this file ships in a patched folder's remote code. `core/options.py` (not shipped) derives the same
checks, in the same words, from annotations for every other door (recipe functions, commands)."""

from __future__ import annotations

import dataclasses
import math
import numbers


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
            try:
                value = float(value)  # Fraction(10**400) is no finite number either
            except OverflowError:
                return False
            if self.integer or math.isnan(value) or (math.isinf(value) and not self.allow_inf):
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


def shown(value) -> str:
    """A value as an error names it: its repr, or for an object with a long repr (a whole
    TrainingArguments) its type only."""
    text = repr(value)
    if isinstance(value, int) and len(text) > 40:  # 10**400: its size, not its digits
        return f"{text[:12]}...({len(text.lstrip('-'))} digits)"
    return text if len(text) <= 120 and "\n" not in text else f"<{type(value).__name__} object>"


class RangeError(ValueError):
    """A value outside its option's range; `name`, `value` and `accepted` for the caller's wording."""

    problem = "is out of range"

    def __init__(self, name: str, value, accepted: str):
        self.name, self.value, self.accepted = name, value, accepted
        super().__init__(f"{name}={shown(value)} {self.problem}; accepted: {accepted}.")



class OptionTypeError(RangeError, TypeError):
    """A value of the wrong type for its option (a string for a number, a float for an integer, a 0-dim
    tensor for a number: `.item()` is one)."""

    def __init__(self, name: str, value, accepted: str, number: bool = False):
        zero_dim = number and not isinstance(value, numbers.Number) and getattr(value, "ndim", None) == 0
        self.problem = f"has the wrong type ({type(value).__name__}{', 0-dim: pass .item()' if zero_dim else ''})"
        super().__init__(name, value, accepted)


class ChoiceError(RangeError):
    """A value of the right type that is none of the option's choices (dtype="float64")."""

    problem = "is not one of the choices"


class EmptyOptionError(RangeError):
    """An empty list for an option where an empty list means nothing (seeds=[], variants=[], ...)."""

    problem = "is empty"


# ----------------------------------------------------------------------------- the core's checks
def number(name: str, value, limit: Range, *, none: bool = False, accepted: str | None = None):
    """`value` as a plain int / float within `limit` (an Integral where `limit.integer`); None where `none`."""
    if value is None and none:
        return None
    accepted = accepted or limit.describe() + (", or None" if none else "")
    integral = isinstance(value, numbers.Integral)
    if isinstance(value, bool) or not (integral if limit.integer else isinstance(value, numbers.Real)):
        raise OptionTypeError(name, value, accepted, number=True)
    if not limit.accepts(value):
        raise RangeError(name, value, accepted)
    return value if type(value) in (int, float) else int(value) if integral else float(value)


def choice(name: str, value, choices: tuple, *, none: bool = False) -> str | None:
    """`value` as a plain str among `choices` (a str enum member as its text); None where `none`."""
    if value is None and none:
        return None
    accepted = "one of " + ", ".join(map(repr, choices)) + (", or None" if none else "")
    if not isinstance(value, str):
        raise OptionTypeError(name, value, accepted)
    if str.__str__(value) not in choices:  # the text itself: not a subclass's own __eq__
        raise ChoiceError(name, value, accepted)
    return str.__str__(value)


def flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise OptionTypeError(name, value, "true or false")
    return value


def listed(name: str, value, accepted: str, item, *, empty: bool = True, number: bool = False) -> tuple:
    """A list / tuple as a tuple of `item(value)` for each value; `item` returns None for a wrong one."""
    items = [item(v) for v in value] if isinstance(value, (list, tuple)) else [None]
    if any(v is None for v in items):
        raise OptionTypeError(name, value, accepted, number=number)
    if not items and not empty:
        raise EmptyOptionError(name, value, accepted)
    return tuple(items)


def index(value) -> int | None:
    """A layer index as a plain int; None for anything else."""
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else None
