"""Quantities people type: byte counts (``"24GiB"``) and element counts (``"7B"``), parsed
and printed. Imports nothing heavy (the command line parses with it before torch loads)."""

from __future__ import annotations

import math
import numbers
import operator
import re
from collections.abc import Callable
from decimal import Decimal, DecimalException
from typing import SupportsIndex

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_COUNT_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_COUNT = re.compile(r"^([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)([kmbgt]?)$")
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


MAX_BYTES = 2**63 - 1
"""The largest byte count accepted (what an int64 holds; 8 EiB)."""

MAX_COUNT = MAX_BYTES // 8
"""The largest element count accepted (1,152,921,504,606,846,975): the fp32 rung's state,
8 bytes a param, must stay a byte count."""

_UNITS_ALLOWED = (
    "B, kB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), any case"
)
_BYTES_ALLOWED = (
    f"a number of bytes from 0 to 2**63 - 1 with an optional unit: {_UNITS_ALLOWED}; "
    "e.g. '24GiB', '512MB', '1.5e9'"
)


def _unit_hint(number: str, unit: str) -> str:
    """For a unit people write but that is ambiguous (``G``, ``Gi``, ``K``...), both
    readings; else the list of units."""
    head = unit[:1].lower()
    if head and head in "kmgt" and unit.lower() in (head, head + "i"):
        si = ("k" if head == "k" else head.upper()) + "B"
        iec = head.upper() + "iB"
        return (
            f"unit {unit!r} is ambiguous: write {number}{iec} ({_UNITS[iec.lower()]:,} bytes "
            f"per {iec}, powers of 1024) or {number}{si} ({_UNITS[si.lower()]:,} bytes per "
            f"{si}, powers of 1000)"
        )
    return f"unit {unit!r} is not known"


def parse_bytes(value: object, name: str = "free_memory") -> int:
    """Parse a byte count given as an integer or a string such as ``"24GiB"``.

    Units (case-insensitive): none or ``B``; SI ``kB``, ``MB``, ``GB``, ``TB`` (powers
    of 1000); IEC ``KiB``, ``MiB``, ``GiB``, ``TiB`` (powers of 1024). Fractions are
    allowed and rounded down to whole bytes (``"1.5KiB"`` is 1536). Integers of any
    type with ``__index__`` (``numpy.int64``) count as ints.

    Args:
        value: a number of bytes (``int``, ``float``, NumPy integers and floats) or a
            string.
        name: the argument or variable it came from, for the error message.

    Returns:
        The number of bytes, an ``int`` from 0 to :data:`MAX_BYTES`.

    Raises:
        ValueError: if the value is negative, not finite, over :data:`MAX_BYTES`, or not
            parsable. The message starts with ``name=value``, says what is wrong (for an
            ambiguous unit such as ``"24G"``, both ``"24GiB"`` and ``"24GB"`` with their
            sizes) and what is allowed.
    """

    def error(why: str) -> ValueError:
        return ValueError(f"{name}={value!r} is not a byte count: {why}; expected {_BYTES_ALLOWED}")

    if isinstance(value, bool) or value is None:
        raise error(f"a {type(value).__name__} is not a number")
    if type(value) is str:  # no number type is a str: straight to the text
        return _parse_bytes_text(value, error)
    if (
        isinstance(value, numbers.Real)
        and not isinstance(value, float)
        and not isinstance(value, SupportsIndex)
    ):
        value = float(value)  # numpy.float32 and other real types, as floats
    if isinstance(value, float):
        if not math.isfinite(value):
            raise error("not a finite number")
        if value < 0:
            raise error("negative")
        if value > MAX_BYTES:
            raise error("more than 2**63 - 1 bytes")
        return int(value)
    if isinstance(value, SupportsIndex):  # int, numpy.int64, ...: before float()
        number_int = operator.index(value)
        if number_int < 0:
            raise error("negative")
        if number_int > MAX_BYTES:
            raise error("more than 2**63 - 1 bytes")
        return int(number_int)
    if not isinstance(value, str):
        raise error(f"a {type(value).__name__} is neither a number nor a string")
    return _parse_bytes_text(value, error)


def _parse_bytes_text(value: str, error: Callable[[str], ValueError]) -> int:
    """:func:`parse_bytes` of a string; ``error`` makes its exception from a reason."""
    text = value.strip()
    if text.startswith("-") and _PATTERN.match(text[1:]):
        raise error("negative")
    match = _PATTERN.match(value)
    if match is None:
        raise error("not a number with an optional unit")
    digits, unit = match.group(1), match.group(2)
    if unit.lower() not in _UNITS:
        raise error(_unit_hint(digits, unit))
    # Decimal, not float: "2.01kB" is 2010 bytes, while 2.01 * 1000 is 2009.999... in floats.
    try:  # an exponent past Decimal's range overflows (decimal.Overflow)
        number = Decimal(digits) * _UNITS[unit.lower()]
    except DecimalException:
        raise error("more than 2**63 - 1 bytes") from None
    if number > MAX_BYTES:
        raise error("more than 2**63 - 1 bytes")
    return int(number)


def parse_count(value: object, name: str, minimum: int = 1) -> int:
    """Parse a count of elements such as ``124439808``, ``"7e9"``, ``"1.5B"`` or ``"350M"``.

    Suffixes (case-insensitive): ``k`` (10**3), ``M`` (10**6), ``B`` or ``G`` (10**9),
    ``T`` (10**12). ``_`` and ``,`` separators are ignored. The value must be a whole
    number (``"1.5e9"`` is fine, ``"2.5"`` is not) from ``minimum`` to :data:`MAX_COUNT`
    (so ``"1e308"`` and ``"1e400"`` are refused, not overflowed later).

    Args:
        value: an ``int`` or a string.
        name: the option or argument it came from, for the error message.
        minimum: the least value allowed.

    Returns:
        The count, an ``int`` from ``minimum`` to :data:`MAX_COUNT`.

    Raises:
        ValueError: naming ``name``, the value, and the allowed range and forms.
    """
    error = ValueError(
        f"{name}={value!r} is not a count; expected a whole number >= {minimum:,} and at most "
        f"{MAX_COUNT:,} (2**60 - 1), e.g. 124439808, 7e9, 1.5e9, 7B, 350M"
    )
    if isinstance(value, bool):
        raise error
    if isinstance(value, int):
        number = Decimal(value)
    elif isinstance(value, str):
        text = value.strip().lower().replace("_", "").replace(",", "")
        match = _COUNT.match(text)
        if match is None:
            raise error
        try:
            number = Decimal(match.group(1)) * _COUNT_SUFFIXES[match.group(2)]
        except DecimalException:  # InvalidOperation, or an exponent past Decimal's range
            raise error from None
    else:
        raise error
    if (
        not number.is_finite()
        or number != number.to_integral_value()
        or not minimum <= number <= MAX_COUNT
    ):
        raise error
    return int(number)


def format_bytes(n: int) -> str:
    """Format a byte count for people, e.g. ``1536 -> "1.50 KiB"`` (IEC units)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{n:,} B" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
