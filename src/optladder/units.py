"""Byte quantities: parse ``"24GiB"`` and friends, and print bytes for people."""

from __future__ import annotations

import math
import re

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


def parse_bytes(value: object, name: str = "free_memory") -> int:
    """Parse a byte count given as an integer or a string such as ``"24GiB"``.

    Units (case-insensitive): none or ``B``; SI ``kB``, ``MB``, ``GB``, ``TB`` (powers
    of 1000); IEC ``KiB``, ``MiB``, ``GiB``, ``TiB`` (powers of 1024). Fractions are
    allowed and rounded down to whole bytes (``"1.5KiB"`` is 1536).

    Args:
        value: an ``int``/``float`` number of bytes or a string.
        name: the argument or variable it came from, for the error message.

    Returns:
        The number of bytes, an ``int >= 0``.

    Raises:
        ValueError: if the value is negative, not finite, or not parsable; the message
            names ``name``, the value, and what is allowed.
    """
    allowed = "a number of bytes >= 0, or a string such as '24GiB', '512MB', '1.5e9'"
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not a byte count; expected {allowed}")
    if isinstance(value, (int, float)):
        number, factor = float(value), 1
    elif isinstance(value, str):
        match = _PATTERN.match(value)
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS:
            raise ValueError(f"{name}={value!r} is not a byte count; expected {allowed}")
        number, factor = float(match.group(1)), _UNITS[unit]
    else:
        raise ValueError(f"{name}={value!r} is not a byte count; expected {allowed}")
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{name}={value!r} is not a byte count; expected {allowed}")
    if isinstance(value, int):
        return value
    return int(number * factor)


def format_bytes(n: int) -> str:
    """Format a byte count for people, e.g. ``1536 -> "1.50 KiB"`` (IEC units)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{n:,} B" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
