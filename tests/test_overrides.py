"""read_overrides: the rung= argument and the OPTLADDER_* variables."""

from __future__ import annotations

import warnings

import pytest

from optladder.errors import OptladderWarning
from optladder.policies.overrides import (
    OverrideError,
    Overrides,
    read_overrides,
    unknown_variables,
)

BF16 = "OPTLADDER_BF16_ADAM"
EIGHT = "OPTLADDER_8BIT_ADAM"
RUNG = "OPTLADDER_RUNG"
SWITCHES = [(BF16, "bf16"), (EIGHT, "8bit")]

TRUE_SPELLINGS = ["1", "true", "TRUE", "True", "on", "ON", "oN", " 1 ", " On ", "\ttrue\n"]
FALSE_SPELLINGS = ["0", "false", "FALSE", "False", "off", "OFF", "oFf", " 0 ", " Off ", "\nfalse\t"]


def test_no_variables_means_the_policy_chooses() -> None:
    overrides = read_overrides(environ={"UNRELATED": "1"})
    assert overrides == Overrides()
    assert overrides.origin == "policy"
    assert (overrides.fixed, overrides.forced, overrides.disabled) == (None, None, frozenset())


@pytest.mark.parametrize(("var", "rung"), SWITCHES)
@pytest.mark.parametrize("value", TRUE_SPELLINGS)
def test_switch_on_forces_the_rung(var: str, rung: str, value: str) -> None:
    overrides = read_overrides(environ={var: value})
    assert overrides.forced == rung
    assert overrides.fixed is None
    assert overrides.disabled == frozenset()
    assert overrides.origin == "forced"
    assert overrides.sources == (f"{var}={value}",)


@pytest.mark.parametrize(("var", "rung"), SWITCHES)
@pytest.mark.parametrize("value", FALSE_SPELLINGS)
def test_switch_off_disables_the_rung(var: str, rung: str, value: str) -> None:
    overrides = read_overrides(environ={var: value})
    assert overrides.disabled == frozenset({rung})
    assert overrides.forced is None and overrides.fixed is None
    assert overrides.origin == "policy"
    assert overrides.sources == (f"{var}={value}",)


@pytest.mark.parametrize(
    ("value", "rung"),
    [("fp32", "fp32"), ("bf16", "bf16"), ("8bit", "8bit"), ("BF16", "bf16"), (" 8BIT ", "8bit")],
)
def test_rung_variable_fixes_the_rung(value: str, rung: str) -> None:
    overrides = read_overrides(environ={RUNG: value})
    assert overrides.fixed == rung
    assert overrides.origin == "fixed"
    assert overrides.sources == (f"{RUNG}={value}",)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        # agreeing variables
        ({RUNG: "bf16", BF16: "1"}, Overrides(fixed="bf16")),
        ({RUNG: "8bit", EIGHT: "on"}, Overrides(fixed="8bit")),
        ({RUNG: "fp32", EIGHT: "0"}, Overrides(fixed="fp32", disabled=frozenset({"8bit"}))),
        ({RUNG: "fp32", BF16: "off"}, Overrides(fixed="fp32", disabled=frozenset({"bf16"}))),
        ({BF16: "1", EIGHT: "0"}, Overrides(forced="bf16", disabled=frozenset({"8bit"}))),
        ({BF16: "false", EIGHT: "true"}, Overrides(forced="8bit", disabled=frozenset({"bf16"}))),
        ({BF16: "0", EIGHT: "0"}, Overrides(disabled=frozenset({"bf16", "8bit"}))),
    ],
)
def test_variables_combine(env: dict[str, str], expected: Overrides) -> None:
    got = read_overrides(environ=env)
    assert (got.fixed, got.forced, got.disabled) == (
        expected.fixed,
        expected.forced,
        expected.disabled,
    )
    assert set(got.sources) == {f"{k}={v}" for k, v in env.items()}


@pytest.mark.parametrize(
    "env",
    [
        {},
        {BF16: "1"},
        {EIGHT: "0"},
        {RUNG: "8bit"},
        {RUNG: "bf16", BF16: "1", EIGHT: "1"},  # contradictory, but rung= beats them all
        {RUNG: "fp32", BF16: "0", EIGHT: "0"},
    ],
)
@pytest.mark.parametrize("rung", ["fp32", "bf16", "8bit", "BF16"])
def test_rung_argument_beats_every_variable(env: dict[str, str], rung: str) -> None:
    overrides = read_overrides(rung=rung, environ=env)
    assert overrides.fixed == rung.lower()
    assert overrides.forced is None
    assert overrides.disabled == frozenset()
    assert overrides.sources[0] == f"rung={rung.lower()!r}"
    if env:
        assert len(overrides.sources) == 2
        note = overrides.sources[1]
        assert "overrides" in note
        for k, v in env.items():
            assert f"{k}={v}" in note  # names each variable it overrode
    else:
        assert len(overrides.sources) == 1


def test_rung_argument_still_checks_variable_values() -> None:
    with pytest.raises(OverrideError, match=BF16):
        read_overrides(rung="fp32", environ={BF16: "maybe"})
    with pytest.raises(OverrideError, match=RUNG):
        read_overrides(rung="fp32", environ={RUNG: "fp16"})


@pytest.mark.parametrize("rung", ["fp16", "", "adam", "8-bit"])
def test_unknown_rung_argument(rung: str) -> None:
    with pytest.raises(ValueError, match=r"rung=.*accepted values: fp32, bf16, 8bit"):
        read_overrides(rung=rung, environ={})


@pytest.mark.parametrize(
    ("var", "value", "accepted"),
    [
        (BF16, "yes", "1, 0, true, false, on, off"),
        (BF16, "2", "1, 0, true, false, on, off"),
        (BF16, "", "1, 0, true, false, on, off"),
        (BF16, "enable", "1, 0, true, false, on, off"),
        (EIGHT, "maybe", "1, 0, true, false, on, off"),
        (EIGHT, "-1", "1, 0, true, false, on, off"),
        (RUNG, "fp16", "fp32, bf16, 8bit"),
        (RUNG, "int8", "fp32, bf16, 8bit"),
        (RUNG, "", "fp32, bf16, 8bit"),
    ],
)
def test_unknown_values_raise_naming_variable_value_and_accepted(
    var: str, value: str, accepted: str
) -> None:
    with pytest.raises(OverrideError) as info:
        read_overrides(environ={var: value})
    message = str(info.value)
    assert f"{var}={value!r}" in message
    assert accepted in message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("key", [5, b"OPTLADDER_RUNG", None])
def test_an_environ_key_that_is_no_str_is_refused_naming_it(key: object) -> None:
    """A key that is no str (an int, bytes) was an AttributeError from ``name.upper()``."""
    with pytest.raises(
        TypeError,
        match=rf"mapping of str to str; it holds the key {key!r} \({type(key).__name__}\)",
    ):
        read_overrides(environ={RUNG: "bf16", key: "x"})  # type: ignore[dict-item]


@pytest.mark.parametrize(
    "env",
    [
        {BF16: "1", EIGHT: "1"},
        {BF16: "on", EIGHT: "TRUE"},
        {RUNG: "bf16", BF16: "0"},
        {RUNG: "8bit", EIGHT: "off"},
        {RUNG: "fp32", BF16: "1"},
        {RUNG: "fp32", EIGHT: "1"},
        {RUNG: "bf16", EIGHT: "1"},
    ],
)
def test_contradictions_raise_naming_both_variables(env: dict[str, str]) -> None:
    with pytest.raises(OverrideError, match="contradict") as info:
        read_overrides(environ=env)
    for k, v in env.items():
        assert f"{k}={v}" in str(info.value)


def test_environ_none_reads_os_environ_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (BF16, EIGHT, RUNG):
        monkeypatch.delenv(var, raising=False)
    assert read_overrides() == Overrides()
    monkeypatch.setenv(BF16, " On ")
    assert read_overrides().forced == "bf16"
    monkeypatch.setenv(EIGHT, "0")
    got = read_overrides()
    assert (got.forced, got.disabled) == ("bf16", frozenset({"8bit"}))
    assert set(got.sources) == {f"{BF16}= On ", f"{EIGHT}=0"}
    monkeypatch.setenv(RUNG, "bf16")
    assert read_overrides().fixed == "bf16"
    monkeypatch.setenv(EIGHT, "bogus")
    with pytest.raises(OverrideError, match=f"{EIGHT}='bogus'"):
        read_overrides()
    monkeypatch.delenv(EIGHT)
    monkeypatch.delenv(RUNG)
    monkeypatch.delenv(BF16)
    assert read_overrides() == Overrides()


def test_os_environ_names_are_case_sensitive(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (BF16, EIGHT, RUNG):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(BF16.lower(), "1")
    monkeypatch.setenv("OPTLADDER_EIGHT_BIT_ADAM", "1")  # a field name, not the variable
    monkeypatch.setenv("OPTLADDER_UNRELATED", "x")
    with pytest.warns(OptladderWarning) as record:
        assert read_overrides() == Overrides()
    # ignored, but each said aloud
    warned = sorted(str(w.message).split("=")[0] for w in record)
    assert warned == sorted([BF16.lower(), "OPTLADDER_EIGHT_BIT_ADAM", "OPTLADDER_UNRELATED"])


# Misspellings people write, and the variable each one meant (by hand).
MISSPELLINGS = [
    ("OPTLADDER_8BIT", "OPTLADDER_8BIT_ADAM"),
    ("OPTLADDER_BF16", "OPTLADDER_BF16_ADAM"),
    ("OPTLADDER_BF16ADAM", "OPTLADDER_BF16_ADAM"),
    ("OPTLADDER_8BIT_ADAMW", "OPTLADDER_8BIT_ADAM"),
    ("OPTLADDER_RUNGS", "OPTLADDER_RUNG"),
    ("OPTLADDER_RUN", "OPTLADDER_RUNG"),
    ("Optladder_Bf16", "OPTLADDER_BF16_ADAM"),
]


@pytest.mark.parametrize(("name", "meant"), MISSPELLINGS)
def test_a_misspelled_variable_warns_naming_the_closest(name: str, meant: str) -> None:
    with pytest.warns(OptladderWarning) as record:
        assert read_overrides(environ={name: "1"}) == Overrides()  # ignored
    (warning,) = record
    assert str(warning.message) == (
        f"{name}='1' is not an optladder variable and is ignored; did you mean {meant}? "
        "(optladder reads OPTLADDER_BF16_ADAM, OPTLADDER_8BIT_ADAM, OPTLADDER_RUNG)"
    )


@pytest.mark.parametrize("name", [BF16, EIGHT, RUNG])
def test_a_known_name_in_another_case_warns_that_names_are_case_sensitive(name: str) -> None:
    value = "bf16" if name == RUNG else "1"
    with pytest.warns(OptladderWarning, match=f"names are case-sensitive: did you mean {name}\\?"):
        assert read_overrides(environ={name.lower(): value}) == Overrides()


def test_known_and_unrelated_names_do_not_warn() -> None:
    environ = {BF16: "0", EIGHT: "1", "HOME": "/root", "MY_OPTLADDER_X": "1", "OPTLADDER": "1"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_overrides(environ=environ).forced == "8bit"


def test_unknown_variables_lists_every_one_in_order() -> None:
    environ = {"OPTLADDER_8BIT": "1", RUNG: "fp32", "optladder_rung": "bf16", "PATH": "/bin"}
    assert unknown_variables(environ) == [
        ("OPTLADDER_8BIT", "OPTLADDER_8BIT_ADAM"),
        ("optladder_rung", "OPTLADDER_RUNG"),
    ]


def test_choose_optimizer_warns_at_the_callers_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from optladder import choose_optimizer

    monkeypatch.setenv("OPTLADDER_8BIT", "1")
    with pytest.warns(OptladderWarning, match="did you mean OPTLADDER_8BIT_ADAM") as record:
        opt = choose_optimizer(torch.nn.Linear(2, 2), lr=1e-3, free_memory="1GiB")
    assert opt.rung == "fp32"  # the misspelled variable did not act
    (warning,) = [w for w in record if "OPTLADDER_8BIT" in str(w.message)]
    assert warning.filename == __file__  # stacklevel: the user's call, not optladder's
