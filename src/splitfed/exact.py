"""Counts made from a config's decimal numbers, computed exactly.

A config's fractions are written as decimals (``local_epochs: 1.1``), and a count made
from one, such as K = ceil(50 * 1.1), must be the count of the decimal as written: in
binary floating point 50 * 1.1 is 55.00000000000001, whose ceiling is 56, not 55. The
product here is taken in rational arithmetic on the shortest decimal that reads back as
the float (``repr``), so it is exact for every value a config can hold. No imports
beyond the standard library: the config checks use it before torch loads.
"""

from __future__ import annotations

from fractions import Fraction


def decimal(x: float) -> Fraction:
    """The number ``x`` was written as: the shortest decimal that reads back as ``x``."""
    return Fraction(repr(float(x)))


def ceil_times(n: int, x: float) -> int:
    """ceil(n * x) for an integer ``n`` and ``x`` taken as its decimal (module docstring)."""
    p = int(n) * decimal(x)
    return -((-p.numerator) // p.denominator)
