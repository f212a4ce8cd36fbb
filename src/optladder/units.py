"""Byte quantities: parse ``"24GiB"`` and friends, and print bytes for people."""

from __future__ import annotations

import math
import numbers
import re
from decimal import Decimal

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
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


MAX_BYTES = 2**63 - 1
"""The largest byte count accepted (what an int64 holds; 8 EiB)."""


def parse_bytes(value: object, name: str = "free_memory") -> int:
    """Parse a byte count given as an integer or a string such as ``"24GiB"``.

    Units (case-insensitive): none or ``B``; SI ``kB``, ``MB``, ``GB``, ``TB`` (powers
    of 1000); IEC ``KiB``, ``MiB``, ``GiB``, ``TiB`` (powers of 1024). Fractions are
    allowed and rounded down to whole bytes (``"1.5KiB"`` is 1536).

    Args:
        value: a number of bytes (``int``, ``float``, NumPy integers and floats) or a
            string.
        name: the argument or variable it came from, for the error message.

    Returns:
        The number of bytes, an ``int >= 0``.

    Raises:
        ValueError: if the value is negative, not finite, or not parsable; the message
            names ``name``, the value, and what is allowed.
    """
    allowed = "a number of bytes from 0 to 2**63 - 1, or a string such as '24GiB', '512MB', '1.5e9'"
    error = ValueError(f"{name}={value!r} is not a byte count; expected {allowed}")
    if isinstance(value, bool):
        raise error
    if isinstance(value, numbers.Integral) and not isinstance(value, int):
        value = int(value)  # NumPy integers, as NumPy floats are taken below
    elif isinstance(value, numbers.Real) and not isinstance(value, int | float):
        value = float(value)
    if isinstance(value, int):  # before float(): a huge int does not fit a float
        if not 0 <= value <= MAX_BYTES:
            raise error
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or not 0 <= value <= MAX_BYTES:
            raise error
        return int(value)
    if not isinstance(value, str):
        raise error
    match = _PATTERN.match(value)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise error
    # Decimal, not float: "2.01kB" is 2010 bytes, while 2.01 * 1000 is 2009.999... in floats.
    number = Decimal(match.group(1))
    if not math.isfinite(float(number)):  # "1e400": refuse, as a float value would be
        raise error
    result = int(number * _UNITS[unit])
    if result > MAX_BYTES:
        raise error
    return result


def format_bytes(n: int) -> str:
    """Format a byte count for people, e.g. ``1536 -> "1.50 KiB"`` (IEC units)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{n:,} B" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
