"""Declared ranges of numeric settings, written once where the setting is declared.

A constructor (or builder function) that a config group instantiates declares the range of a
numeric argument in its signature::

    def __init__(self, mu: Positive = 0.01, server_lr: Annotated[float, Range(gt=0)] = 1.0)

:func:`fedexp.config.instantiate.check_node` reads the annotations (with
``typing.get_type_hints(..., include_extras=True)``) and refuses, before any data is loaded or
anything is tracked, a value of the wrong type, a non-finite float (NaN always; infinity
unless the range says ``inf=True``) and a value outside the declared range, in one line that
names the key, the value and the range: ``algorithm.mu=-1.0: expected > 0``.

The module imports nothing heavy: the aliases below are plain :class:`typing.Annotated` types.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass
from typing import Annotated, Any


@dataclass(frozen=True)
class Range:
    """The interval a numeric setting must lie in; None leaves that side open.

    Attributes:
        ge: inclusive lower bound.
        gt: exclusive lower bound.
        le: inclusive upper bound.
        lt: exclusive upper bound.
        inf: whether +infinity is allowed (e.g. a norm bound ``C = inf`` that clips nothing).
        note: what the bounds mean, appended to the message (``"0 disables"``).
    """

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    inf: bool = False
    note: str = ""

    def describe(self) -> str:
        """The range in words: ``"> 0"``, ``"in [0, 1]"``, ``"≥ 1"``, ``"a finite number"``."""
        low = (
            ("[", self.ge)
            if self.ge is not None
            else ("(", self.gt)
            if self.gt is not None
            else None
        )
        high = (
            (self.le, "]")
            if self.le is not None
            else (self.lt, ")")
            if self.lt is not None
            else None
        )
        if low and high:
            text = f"in {low[0]}{_num(low[1])}, {_num(high[0])}{high[1]}"
        elif low:
            text = f"{'≥' if low[0] == '[' else '>'} {_num(low[1])}"
        elif high:
            text = f"{'≤' if high[1] == ']' else '<'} {_num(high[0])}"
        else:
            text = "a finite number"
        if self.inf:
            text += " (or inf)"
        return f"{text}; {self.note}" if self.note else text

    def contains(self, value: float) -> bool:
        """Whether ``value`` (a number) lies in the range; NaN never does."""
        if math.isnan(value) or (math.isinf(value) and not (self.inf and value > 0)):
            return False
        return not (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
            or (self.lt is not None and value >= self.lt)
        )

    def outside(self) -> tuple[float, ...]:
        """Finite values just outside the range, one per bounded side (for tests)."""
        below = (
            float(self.gt)
            if self.gt is not None
            else float(self.ge) - 1
            if self.ge is not None
            else None
        )
        above = (
            float(self.lt)
            if self.lt is not None
            else float(self.le) + 1
            if self.le is not None
            else None
        )
        return tuple(v for v in (below, above) if v is not None)


def _num(value: float) -> str:
    return f"{value:g}"


def range_of(annotation: Any) -> Range | None:
    """The :class:`Range` declared in ``annotation`` (``Annotated[...]`` or ``X | None``)."""
    if typing.get_origin(annotation) is Annotated:
        return next((m for m in annotation.__metadata__ if isinstance(m, Range)), None)
    for arg in typing.get_args(annotation):  # Optional[Annotated[...]]
        found = range_of(arg)
        if found is not None:
            return found
    return None


#: ``> 0`` (a step size, a penalty weight that must act, a scale).
Positive = Annotated[float, Range(gt=0)]
#: ``≥ 0`` (a penalty weight, where 0 switches it off).
NonNegative = Annotated[float, Range(ge=0)]
#: ``[0, 1]`` (a probability, a mixing weight, a momentum).
Fraction = Annotated[float, Range(ge=0, le=1)]
#: ``(0, 1]`` (a share of coordinates or of data that must not be empty).
PositiveFraction = Annotated[float, Range(gt=0, le=1)]
#: ``[0, 1)`` (a dropout probability, Adam's betas).
OpenFraction = Annotated[float, Range(ge=0, lt=1)]
#: ``≥ 1`` (a count of layers, steps, neighbours, units).
PositiveInt = Annotated[int, Range(ge=1)]
#: ``≥ 0`` (a count that may be 0).
NonNegativeInt = Annotated[int, Range(ge=0)]
