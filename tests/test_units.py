"""parse_bytes and format_bytes: byte quantities given by people."""

from __future__ import annotations

import pytest

from optladder.units import MAX_BYTES, MAX_COUNT, format_bytes, parse_bytes, parse_count


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


def test_parse_bytes_takes_integers_of_any_type() -> None:
    np = pytest.importorskip("numpy")
    assert parse_bytes(np.int64(2**33)) == 2**33
    assert type(parse_bytes(np.int64(5))) is int
    with pytest.raises(ValueError, match="negative"):
        parse_bytes(np.int32(-1))


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("-5GiB", "negative"),
        (-1, "negative"),
        ("24XB", "unit 'XB' is not known"),
        ("lots", "not a number with an optional unit"),
        ("1e400", "more than 2**63 - 1 bytes"),
        ("1e999999999", "more than 2**63 - 1 bytes"),  # past Decimal's exponent range
        ("1e999999999GiB", "more than 2**63 - 1 bytes"),
        (2**63, "more than 2**63 - 1 bytes"),
        (float("inf"), "not a finite number"),
        ([1], "a list is neither a number nor a string"),
    ],
)
def test_parse_bytes_says_what_is_wrong(value: object, why: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_bytes(value, "--free-memory")
    assert str(info.value).startswith(f"--free-memory={value!r} is not a byte count: {why}; ")


def test_an_ambiguous_unit_gives_both_readings() -> None:
    with pytest.raises(ValueError) as info:
        parse_bytes("24G")
    assert "write 24GiB (1,073,741,824 bytes per GiB, powers of 1024)" in str(info.value)
    assert "or 24GB (1,000,000,000 bytes per GB, powers of 1000)" in str(info.value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("7B", 7 * 10**9), ("1.5e9", 1_500_000_000), ("1152921504606846975", 2**60 - 1)],
)
def test_parse_count_accepts_up_to_max_count(value: str, expected: int) -> None:
    assert parse_count(value, "--params") == expected
    assert MAX_COUNT == 2**60 - 1 == MAX_BYTES // 8  # fp32 state, 8 bytes a param, fits


@pytest.mark.parametrize(
    "value", ["1e308", "1e400", "1e999999999", "1e999999999T", "1152921504606846976", 2**60, "0"]
)
def test_parse_count_refuses_over_max_count(value: object) -> None:
    with pytest.raises(ValueError, match=r"^--params=.* is not a count; expected a whole number"):
        parse_count(value, "--params")
