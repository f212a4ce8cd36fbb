"""parse_bytes and format_bytes: byte quantities given by people."""

from __future__ import annotations

import pytest

from optladder.units import format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        # IEC units are powers of 1024, SI units powers of 1000; any case, spaces allowed.
        ("24GiB", 24 * 2**30),  # 25,769,803,776
        (" 24 gib ", 24 * 2**30),
        ("512MB", 512 * 10**6),
        ("512mb", 512 * 10**6),
        ("1.5KiB", 1536),  # 1.5 * 1024
        ("0.5MiB", 2**19),  # 524,288
        ("2MiB", 2 * 2**20),  # the demo's example
        ("3TiB", 3 * 2**40),
        ("1TB", 10**12),
        ("1kB", 1000),
        ("7B", 7),
        ("7b", 7),
        ("100", 100),
        ("0", 0),
        ("1e9", 10**9),
        ("1.5e9", 1_500_000_000),
        ("1.5e3kB", 1_500_000),  # 1500 * 1000
        # Exact decimal arithmetic: in floats 2.01 * 1000 is 2009.9999999999998.
        ("2.01kB", 2010),
        ("8.03kB", 8030),
        # Fractions of a byte are rounded down: 1.9 B -> 1, 0.1 KiB = 102.4 B -> 102.
        ("1.9", 1),
        ("0.1KiB", 102),
        (0, 0),
        (12_345, 12_345),
        (2**63 - 1, 2**63 - 1),  # the largest accepted: an int64
        (1.9, 1),
        (1e9, 10**9),
    ],
)
def test_parse_bytes_accepts(value: object, expected: int) -> None:
    got = parse_bytes(value)
    assert got == expected
    assert type(got) is int


@pytest.mark.parametrize(
    "value",
    [
        -1,
        -0.5,
        "-1",
        "-1GiB",
        float("nan"),
        "nan",
        float("inf"),
        "inf",
        "1e400",  # not a finite float
        "12XB",
        "12 K",  # a bare K is not a unit
        "",
        "   ",
        "GiB",
        "1.2.3",
        "1,000",
        True,
        False,
        None,
        [1],
        b"1GiB",
    ],
)
def test_parse_bytes_rejects_and_names_the_argument(value: object) -> None:
    with pytest.raises(ValueError) as info:
        parse_bytes(value)
    message = str(info.value)
    assert message.startswith(f"free_memory={value!r} ")  # the argument name and the value
    assert "from 0 to 2**63 - 1" in message  # the allowed forms
    assert "'24GiB'" in message


def test_parse_bytes_names_the_given_argument() -> None:
    with pytest.raises(ValueError, match=r"^--free-memory='lots' is not a byte count"):
        parse_bytes("lots", name="--free-memory")


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1,023 B"),
        (1536, "1.50 KiB"),  # 1536 / 1024
        (3 * 2**20, "3.00 MiB"),
        (24 * 2**30, "24.00 GiB"),
        (5 * 2**40, "5.00 TiB"),
        (2**50, "1024.00 TiB"),  # TiB is the largest unit
    ],
)
def test_format_bytes(n: int, expected: str) -> None:
    assert format_bytes(n) == expected


@pytest.mark.parametrize("value", [2**63, 10**400, "1e300TiB", 1e30])
def test_parse_bytes_refuses_more_than_an_int64(value: object) -> None:
    with pytest.raises(ValueError, match="from 0 to 2\\*\\*63 - 1"):
        parse_bytes(value)
