"""Overrides: the user's word on the rung, from the ``rung=`` argument or the environment.

Variables (read when :func:`read_overrides` is called, never at import):

- ``OPTLADDER_BF16_ADAM``: ``1`` forces the bf16 rung past the memory gate; ``0`` removes
  it from the choices.
- ``OPTLADDER_8BIT_ADAM``: the same for the 8-bit rung.
- ``OPTLADDER_RUNG``: fixes the rung (``fp32``, ``bf16`` or ``8bit``): used past the
  memory gate, never escalated.

Booleans accept ``1/0/true/false/on/off`` in any case. The ``rung=`` argument beats every
variable. The style follows the seed design's ``AIDOTNET_BF16_ADAM`` switch.

Names are case-sensitive. Any other name that starts with ``OPTLADDER_`` in any case
(``OPTLADDER_8BIT=1``, ``optladder_rung=bf16``) is ignored with an
:class:`optladder.OptladderWarning` naming the closest known variable
(:func:`unknown_variables`), so a typo is not silently a no-op.
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from optladder.errors import OptladderWarning, user_stacklevel
from optladder.rungs import Rung, parse_rung

ENV_BF16 = "OPTLADDER_BF16_ADAM"
ENV_8BIT = "OPTLADDER_8BIT_ADAM"
ENV_RUNG = "OPTLADDER_RUNG"
KNOWN_VARIABLES = (ENV_BF16, ENV_8BIT, ENV_RUNG)
"""Every environment variable optladder reads (case-sensitive)."""
_PREFIX = "OPTLADDER_"
_TRUE = ("1", "true", "on")
_FALSE = ("0", "false", "off")
_BOOL_VALUES = "1, 0, true, false, on, off (any case)"


class OverrideError(ValueError):
    """An override variable or argument has an unknown value or contradicts another."""


class _EnvVars(BaseSettings):
    """The raw strings of the optladder variables (pydantic-settings reads them)."""

    model_config = SettingsConfigDict(env_prefix="OPTLADDER_", case_sensitive=True)

    BF16_ADAM: str | None = None
    RUNG: str | None = None
    eight_bit_adam: str | None = Field(default=None, validation_alias=ENV_8BIT)


class Overrides(BaseModel):
    """What the user said about rungs, as plain data for :func:`optladder.decide`.

    Attributes:
        fixed: a rung that must be used and never changed (``rung=`` or
            ``OPTLADDER_RUNG``); it bypasses the memory gate. *Pinned* names a param
            group's own rung, not this; ``pinned``, this field's name in earlier
            versions, is still accepted on input, so the decisions they serialized load.
        forced: a rung asked for with ``=1``; it bypasses the memory gate.
        disabled: rungs removed from the choices with ``=0``.
        sources: per effective setting, where it came from, e.g.
            ``"OPTLADDER_BF16_ADAM=1"``; the decision's reasons quote them.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    fixed: Rung | None = None
    forced: Rung | None = None
    disabled: frozenset[Rung] = frozenset()
    sources: tuple[str, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _old_field_name(cls, data: Any) -> Any:
        """Take ``pinned``, this model's name for :attr:`fixed` in earlier versions (a
        serialized decision's ``overrides``), as ``fixed``.

        Raises:
            ValueError: both ``pinned`` and ``fixed`` given, with different values.
        """
        if not isinstance(data, Mapping) or "pinned" not in data:
            return data
        data = dict(data)
        old = data.pop("pinned")
        if data.get("fixed", old) != old:
            raise ValueError(
                f"pinned={old!r} and fixed={data['fixed']!r} contradict: 'pinned' is the old "
                "name of 'fixed'; give fixed only"
            )
        data["fixed"] = old
        return data

    def __setstate__(self, state: dict[Any, Any]) -> None:
        """Unpickle, taking ``pinned`` (this field's name in earlier versions: an
        Overrides pickled then) as ``fixed``."""
        fields = state.get("__dict__", {})
        if "pinned" in fields:
            new = {"fixed" if name == "pinned" else name: v for name, v in fields.items()}
            was_set = state.get("__pydantic_fields_set__", set())
            was_set = {"fixed" if name == "pinned" else name for name in was_set}
            state = {**state, "__dict__": new, "__pydantic_fields_set__": was_set}
        super().__setstate__(state)

    @property
    def pinned(self) -> Rung | None:
        """Deprecated name of :attr:`fixed` (warns ``FutureWarning``)."""
        warnings.warn(
            "Overrides.pinned is now Overrides.fixed ('pinned' names a param group's own rung)",
            FutureWarning,
            stacklevel=2,
        )
        return self.fixed

    @property
    def origin(self) -> Literal["fixed", "forced", "policy"]:
        """``"fixed"``, ``"forced"`` or ``"policy"``: who chooses the rung."""
        if self.fixed is not None:
            return "fixed"
        return "forced" if self.forced is not None else "policy"


def _parse_switch(name: str, value: object) -> bool | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise OverrideError(f"{name}={value!r} must be a string; accepted values: {_BOOL_VALUES}")
    text = value.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise OverrideError(f"{name}={value!r} is not understood; accepted values: {_BOOL_VALUES}")


def unknown_variables(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """The ``OPTLADDER_*`` names in ``environ`` that optladder does not read.

    A name counts when it starts with ``OPTLADDER_`` in any case and is not exactly one
    of :data:`KNOWN_VARIABLES`; so ``optladder_rung`` (the right name in the wrong case)
    is unknown too.

    Args:
        environ: the environment, e.g. ``os.environ``.

    Returns:
        ``(name, closest)`` pairs in ``environ``'s order: ``closest`` is the known
        variable nearest to ``name.upper()`` by :func:`difflib.SequenceMatcher`'s ratio
        (the one :func:`difflib.get_close_matches` ranks first).
    """
    found = []
    for name in environ:
        if name in KNOWN_VARIABLES or not name.upper().startswith(_PREFIX):
            continue
        closest = difflib.get_close_matches(name.upper(), KNOWN_VARIABLES, n=1, cutoff=0.0)
        found.append((name, closest[0]))
    return found


def _warn_unknown(environ: Mapping[str, str]) -> None:
    for name, closest in unknown_variables(environ):
        if name.upper() == closest:
            hint = f"names are case-sensitive: did you mean {closest}?"
        else:
            hint = f"did you mean {closest}?"
        warnings.warn(
            f"{name}={environ[name]!r} is not an optladder variable and is ignored; {hint} "
            f"(optladder reads {', '.join(KNOWN_VARIABLES)})",
            OptladderWarning,
            stacklevel=user_stacklevel(),
        )


def read_overrides(rung: str | None = None, environ: Mapping[str, str] | None = None) -> Overrides:
    """Read the overrides from the ``rung=`` argument and the environment.

    Args:
        rung: the ``rung=`` argument of :func:`optladder.choose_optimizer`; when given it
            fixes that rung and the variables' choices are ignored (their values are
            still checked).
        environ: the environment to read; ``None`` means ``os.environ`` (read now).

    Returns:
        The :class:`Overrides`.

    Warns:
        OptladderWarning: once per ``OPTLADDER_*`` name (any case) that is not one of
            :data:`KNOWN_VARIABLES`, naming the closest known one; it is ignored.

    Raises:
        TypeError: ``environ`` has a key that is not a str, naming it.
        OverrideError: for an unknown value (naming the variable, its value and the
            accepted values) or a contradiction (both ``=1``; ``OPTLADDER_RUNG`` naming
            a rung that a ``=1`` or ``=0`` variable contradicts).
    """
    for name in environ or ():
        if not isinstance(name, str):  # name.upper() had raised an AttributeError
            raise TypeError(
                f"environ must be a mapping of str to str; it holds the key {name!r} "
                f"({type(name).__name__})"
            )
    _warn_unknown(os.environ if environ is None else environ)
    if environ is None and any(name in os.environ for name in KNOWN_VARIABLES):
        raw = _EnvVars()
        bf16_raw, eight_raw, rung_raw = raw.BF16_ADAM, raw.eight_bit_adam, raw.RUNG
    elif environ is None:  # none set (~0.1 us, against ~0.7 ms for the settings' sources)
        bf16_raw = eight_raw = rung_raw = None
    else:
        bf16_raw, eight_raw, rung_raw = (environ.get(k) for k in (ENV_BF16, ENV_8BIT, ENV_RUNG))
    switches: dict[Rung, tuple[str, bool | None]] = {
        "bf16": (f"{ENV_BF16}={bf16_raw}", _parse_switch(ENV_BF16, bf16_raw)),
        "8bit": (f"{ENV_8BIT}={eight_raw}", _parse_switch(ENV_8BIT, eight_raw)),
    }
    env_rung: Rung | None = None
    if rung_raw is not None:
        try:
            env_rung = parse_rung(rung_raw, ENV_RUNG)
        except ValueError as exc:
            raise OverrideError(str(exc)) from None

    if rung is not None:
        arg_rung = parse_rung(rung, "rung")
        ignored = [src for src, on in switches.values() if on is not None]
        if env_rung is not None:
            ignored.append(f"{ENV_RUNG}={rung_raw}")
        sources = [f"rung={arg_rung!r}"]
        if ignored:
            sources.append(f"rung={arg_rung!r} overrides " + ", ".join(ignored))
        return Overrides(fixed=arg_rung, sources=tuple(sources))

    forced = [(r, src) for r, (src, on) in switches.items() if on is True]
    disabled = {r: src for r, (src, on) in switches.items() if on is False}
    if len(forced) > 1:
        raise OverrideError(
            f"{forced[0][1]} and {forced[1][1]} contradict: at most one rung can be forced; "
            "set one of them to 0 or unset it"
        )
    sources = [src for src, on in switches.values() if on is not None]
    if env_rung is not None:
        for r, src in forced:
            if r != env_rung:
                raise OverrideError(f"{ENV_RUNG}={rung_raw} contradicts {src}; unset one of them")
        if env_rung in disabled:
            raise OverrideError(
                f"{ENV_RUNG}={rung_raw} contradicts {disabled[env_rung]}; unset one of them"
            )
        return Overrides(
            fixed=env_rung,
            disabled=frozenset(disabled),
            sources=(f"{ENV_RUNG}={rung_raw}", *sources),
        )
    return Overrides(
        forced=forced[0][0] if forced else None,
        disabled=frozenset(disabled),
        sources=tuple(sources),
    )
