"""Valid ranges of numeric options, declared once and checked in one place.

An options dataclass (a command's arguments, TangentTrainingArguments, HealSettings) lists its
ranges in `RANGES` and calls `check_ranges(self)` in `__post_init__`, so the command line, recipes
and the Python API refuse the same values with the same message; a library function that takes
the options as keywords checks them with `check_values(RANGES, name=value, ...)`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers


@dataclasses.dataclass(frozen=True)
class Range:
    """low <= value <= high (`open_low` / `open_high`: strict); None: unbounded. `integer`: an int."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    integer: bool = False

    def accepts(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
            return False
        if self.integer and not isinstance(value, numbers.Integral):
            return False
        if self.low is not None and (value <= self.low if self.open_low else value < self.low):
            return False
        return not (self.high is not None and (value >= self.high if self.open_high else value > self.high))

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        low = None if self.low is None else f"{'>' if self.open_low else '>='} {self.low:g}"
        high = None if self.high is None else f"{'<' if self.open_high else '<='} {self.high:g}"
        return " and ".join([f"{kind} {low or high or ''}".strip()] + ([high] if low and high else []))


def at_least(low, integer: bool = True) -> Range:
    return Range(low=low, integer=integer)


class RangeError(ValueError):
    """A value outside its option's range; `name`, `value` and `accepted` for the caller's wording."""

    def __init__(self, name: str, value, accepted: str):
        self.name, self.value, self.accepted = name, value, accepted
        super().__init__(f"{name}={value!r} is out of range; accepted: {accepted}.")

    def as_option(self) -> str:
        """The same error in command-line words: `--seq-len 1 is out of range; accepted: ...`."""
        return f"--{self.name.replace('_', '-')} {self.value} is out of range; accepted: {self.accepted}."


def check_values(ranges: dict[str, Range], **values) -> None:
    """Every value (every element of a list value) within its range; None means 'not set'."""
    for name, value in values.items():
        if value is None or name not in ranges:
            continue
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if not ranges[name].accepts(item):
                raise RangeError(name, value, ranges[name].describe())


def check_ranges(options) -> None:
    """check_values for an options dataclass: its RANGES against its fields."""
    check_values(type(options).RANGES, **{name: getattr(options, name) for name in type(options).RANGES})


# the ranges of the options every analysis shares (experiments and the command line)
TEXT_RANGES = {"seq_len": at_least(2), "max_windows": at_least(1), "batch_size": at_least(1)}
