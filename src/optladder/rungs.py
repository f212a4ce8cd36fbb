"""The rungs of the ladder and what a device's kernels can do for each: plain data.

This module sits below ``policies`` and ``optimizers``; both import it, it imports
neither.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

Rung = Literal["fp32", "bf16", "8bit"]
"""One rung: ``fp32`` (float32 moments), ``bf16`` (bfloat16 moments), ``8bit``
(bitsandbytes block-wise quantized moments)."""

RUNGS: tuple[Rung, ...] = ("fp32", "bf16", "8bit")
"""All rungs, from the most expensive to the cheapest; *escalate* moves right."""

BNB_MIN_8BIT_SIZE = 4096
"""bitsandbytes keeps tensors with fewer elements than this in 32-bit state
(``min_8bit_size`` of ``bitsandbytes.optim.optimizer.Optimizer2State``)."""

BNB_BLOCKSIZE = 256
"""Elements per block of bitsandbytes' block-wise optimizer state; one float32 absmax per
block and moment (``Optimizer2State.init_state``, bitsandbytes >= 0.45)."""

FLOAT32_MATH_DTYPES = ("float32", "bfloat16", "float16")
"""Param dtypes an engine that computes in float32 steps exactly: float32 itself, and the
two narrower float types, whose values float32 holds exactly. A float64 param stepped in
float32 math is rounded to float32 precision on every write, even with ``lr=0``."""

LADDER_DTYPES = (*FLOAT32_MATH_DTYPES, "float64")
"""Param dtypes optladder's AdamW (LadderAdamW) steps without rounding the param: those
of :data:`FLOAT32_MATH_DTYPES`, and float64, whose float32 update it adds to the param in
float64 (so a step with ``lr=0`` leaves a float64 param bit for bit)."""
BNB_DTYPES = FLOAT32_MATH_DTYPES
"""Param dtypes bitsandbytes' 8-bit optimizers step (``Optimizer2State.update_step``)."""

BNB_QMAP_BYTES = 2 * 256 * 4
"""bitsandbytes' two 256-entry float32 code books (``dynamic`` for ``exp_avg``,
``udynamic`` for ``exp_avg_sq``), shared by all 8-bit tensors of one device."""


def parse_rung(value: object, name: str) -> Rung:
    """Return ``value`` as a rung, or raise naming ``name``.

    Args:
        value: the user's value, e.g. ``"bf16"`` (case-insensitive, spaces stripped).
        name: the argument or variable it came from, for the error message.

    Raises:
        ValueError: if ``value`` is not one of ``fp32``, ``bf16``, ``8bit``.
    """
    text = str(value).strip().lower() if isinstance(value, str) else None
    for rung in RUNGS:
        if text == rung:
            return rung
    raise ValueError(f"{name}={value!r} is not a rung; accepted values: {', '.join(RUNGS)}")


class KernelRoute(BaseModel):
    """What steps params of one dtype on one rung of one device (plain data).

    Attributes:
        kernel: the kernel in words, e.g. ``"the C kernel"``, ``"torch's fused AdamW"``,
            ``"the eager path"``.
        fused: whether that kernel updates many params per launch.
        reason: why the combination is not fused, when ``fused`` is False.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kernel: str
    fused: bool
    reason: str | None = None

    def describe(self, rung: str, dtype: str) -> str:
        """One line: ``"bf16 rung: bfloat16 params on the C kernel (fused)"``, or the
        kernel and ``(not fused: reason)``."""
        how = "fused" if self.fused else f"not fused: {self.reason or 'no fused kernel'}"
        return f"{rung} rung: {dtype} params on {self.kernel} ({how})"


class Capabilities(BaseModel):
    """What the target device's optimizer kernels can do, per rung (plain data).

    Built by :func:`optladder.optimizers.probe_capabilities` (which runs the probes) and
    read by :func:`optladder.policies.decide` (which never probes).

    Attributes:
        device: the target device, e.g. ``"cuda:0"`` or ``"cpu"``.
        fused: per rung, whether its engine runs on a fused kernel there.
        unfused_reasons: per rung that is not fused, why, in a sentence.
        available: per rung, whether it can be built at all (``8bit`` needs
            bitsandbytes to import).
        unavailable_reasons: per unavailable rung, why.
        slow: per rung known to be slow on this device, why (for instance bitsandbytes
            on the CPU is tens of times slower than torch's fused fp32 AdamW).
        kernels: per rung, per param dtype name, what steps those params
            (:class:`KernelRoute`); empty when not probed.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: str
    fused: dict[Rung, bool]
    unfused_reasons: dict[Rung, str] = Field(default_factory=dict)
    available: dict[Rung, bool] = Field(default_factory=lambda: dict.fromkeys(RUNGS, True))
    unavailable_reasons: dict[Rung, str] = Field(default_factory=dict)
    slow: dict[Rung, str] = Field(default_factory=dict)
    kernels: dict[Rung, dict[str, KernelRoute]] = Field(default_factory=dict)


@dataclass(frozen=True)
class RungAccepts:
    """What one rung steps exactly: one row of :data:`RUNG_ACCEPTS` (plain data).

    Attributes:
        dtypes: names of the param dtypes the rung steps, e.g. ``("float32", ...)``.
        complex: whether complex params are among them.
        sharded: whether DTensor (FSDP2) params are stepped (on their local shards).
        sharded_reason: why not, when ``sharded`` is False.
        min_quantized_numel: the size rule: a param of at least this many elements (a
            DTensor's global count) gets quantized state, a smaller one float32 moments;
            None when the rung has no size rule.
        engine: what steps it, in which arithmetic, and where the rule comes from.
    """

    dtypes: tuple[str, ...]
    complex: bool
    sharded: bool
    sharded_reason: str = ""
    min_quantized_numel: int | None = None
    engine: str = ""


LOW_PRECISION_DTYPES = ("bfloat16", "float16")
"""Dtypes the fp32 rung steps on optladder's kernels (float32 moments and math), because
torch's AdamW would keep their moments in their own dtype."""

RUNG_ACCEPTS: dict[Rung, RungAccepts] = {
    "fp32": RungAccepts(
        dtypes=("float32", "float64", "bfloat16", "float16", "complex64", "complex128"),
        complex=True,
        sharded=True,
        engine=(
            "optladder's LadderAdamW, fp32 format: float32, float64 and complex params on "
            "torch's AdamW kernels (fused; foreach for complex params or where the device "
            "has no fused kernel), math and moments in the param's dtype; bfloat16 and "
            "float16 params on optladder's kernels, float32 moments and math"
        ),
    ),
    "bf16": RungAccepts(
        dtypes=LADDER_DTYPES,
        complex=False,
        sharded=False,
        sharded_reason=(
            "the bf16 rung's AdamW (LadderAdamW) steps plain tensors only, not DTensor "
            "(FSDP2) params"
        ),
        engine=(
            "optladder's LadderAdamW: bfloat16 moments, float32 math; a float64 param gets "
            "the float32 update added in float64 (the param is never rounded)"
        ),
    ),
    "8bit": RungAccepts(
        dtypes=BNB_DTYPES,
        complex=False,
        sharded=True,
        min_quantized_numel=BNB_MIN_8BIT_SIZE,
        engine=(
            "bitsandbytes' AdamW8bit (Optimizer2State.update_step: float32, bfloat16 and "
            "float16 params, float32 math); a non-contiguous param is stepped through a "
            "contiguous copy written back in place"
        ),
    ),
}
"""What each rung accepts: the one table read by ``decide`` (which rungs the policy may
pick), the param checks of construction, ``add_param_group``, moves and checkpoint loads,
and the engines' own builders."""


def quantizes(numel: int) -> bool:
    """Whether the 8bit rung keeps a param of ``numel`` elements in 8-bit state.

    The size rule of :data:`RUNG_ACCEPTS` (``min_quantized_numel``: bitsandbytes'
    ``min_8bit_size``, 4,096): a smaller param keeps float32 moments there.

    Args:
        numel: the param's element count; a DTensor's global count, as bitsandbytes'
            FSDP path decides on the full param.
    """
    limit = RUNG_ACCEPTS["8bit"].min_quantized_numel
    assert limit is not None  # the 8bit row has a size rule
    return numel >= limit


PARAM_DTYPES: tuple[str, ...] = tuple(
    dict.fromkeys(d for accepts in RUNG_ACCEPTS.values() for d in accepts.dtypes)
)
"""Every param dtype some rung steps; anything else (float8, integers, bool) is refused."""


def _either(names: tuple[str, ...] | list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def param_refusal(rung: Rung, dtype: str, *, sharded: bool = False) -> str | None:
    """Why ``rung`` cannot step one param, from :data:`RUNG_ACCEPTS`, or None.

    Args:
        rung: the rung.
        dtype: the param's dtype name, e.g. ``"float64"``.
        sharded: whether the param is a DTensor.

    Returns:
        A clause such as ``"the 8bit rung takes float32, bfloat16 or float16 params"``.
    """
    accepts = RUNG_ACCEPTS[rung]
    if dtype.startswith("complex") and not accepts.complex:
        return f"the {rung} rung takes real params only: use rung='fp32'"
    if dtype not in accepts.dtypes:
        return f"the {rung} rung takes {_either(list(accepts.dtypes))} params"
    if sharded and not accepts.sharded:
        return accepts.sharded_reason
    return None


def rung_refusal(rung: Rung, dtypes: Iterable[str], *, sharded: bool = False) -> str | None:
    """Why ``rung`` cannot step params of ``dtypes`` together (one engine), or None: the
    rung's table (:data:`RUNG_ACCEPTS`: dtypes, complex, sharded).

    One engine steps every format (:class:`optladder.optimizers.adamw.LadderAdamW`): on
    the fp32 rung float64 and complex params keep their own dtype's moments on torch's
    kernels beside bfloat16/float16 params with float32 moments, so no mix of dtypes the
    rung takes is refused.

    Args:
        rung: the rung.
        dtypes: dtype names of the params, e.g. ``("float32", "float64")``.
        sharded: whether any param is a DTensor.
    """
    accepts = RUNG_ACCEPTS[rung]
    names = sorted(set(dtypes))
    if any(d.startswith("complex") for d in names) and not accepts.complex:
        return f"{rung} takes real params only and the model has complex params"
    other = [d for d in names if d not in accepts.dtypes]
    if other:
        return (
            f"{rung} takes {', '.join(accepts.dtypes)} params and the model has "
            f"{', '.join(other)} params"
        )
    if sharded and not accepts.sharded:
        return accepts.sharded_reason
    return None


RUNG_KEY = "rung"
"""Param-group key holding the group's rung. The optladder optimizer writes it into every
group (param groups survive torch's loader and distributed checkpointing; a top-level
key would not); a user writes it into a group to pin that group's rung."""
ORIGIN_KEY = "rung_origin"
"""Param-group key recording how the group's rung was reached: ``Decision.origin`` for
the groups that follow the decision, :data:`GROUP_PIN_ORIGIN` for a pinned group."""
REASON_KEY = "rung_reason"
"""Param-group key recording why, in a sentence."""
GROUP_PIN_ORIGIN = "group"
"""``ORIGIN_KEY`` of a group that pins its own rung."""


Origin = Literal["policy", "forced", "fixed", "escalated", "checkpoint"]
"""How a decision's rung was reached (``Decision.origin``). ``"fixed"``: the whole
optimizer's rung was fixed by ``rung=`` or ``OPTLADDER_RUNG``, and never moves (a *pinned*
rung is a param group's own, :data:`GROUP_PIN_ORIGIN`)."""
GROUP_ORIGINS: tuple[str, ...] = (*get_args(Origin), GROUP_PIN_ORIGIN)
"""The values ``ORIGIN_KEY`` may hold in a param group (besides :data:`OLD_ORIGINS`)."""
OLD_ORIGINS: Mapping[str, Origin] = {"pinned": "fixed"}
"""Origins written by earlier versions (checkpoints' param groups, serialized decisions),
and what each is called now: ``"pinned"`` was the origin of a rung fixed by ``rung=``."""


def current_origin(origin: object) -> object:
    """``origin`` in today's spelling (:data:`OLD_ORIGINS`); anything else unchanged."""
    return OLD_ORIGINS.get(origin, origin) if isinstance(origin, str) else origin


def group_pin(group: Mapping[str, Any], where: str) -> Rung | None:
    """The rung a param group pins, or None when it follows the decision.

    A group pins its rung when it has a ``"rung"`` entry (:data:`RUNG_KEY`) and either
    no ``"rung_origin"`` entry (a group the user wrote, e.g. ``{"params": emb_params,
    "rung": "fp32"}``, the way bitsandbytes users keep embeddings in 32-bit state) or
    the origin :data:`GROUP_PIN_ORIGIN` (a pinned group the optladder optimizer marked).
    A ``"rung"`` entry with another origin records where a group that follows the
    decision stands, and pins nothing.

    Args:
        group: one param group.
        where: names the group in messages, e.g. ``"param group 2"``.

    Raises:
        ValueError: if ``"rung"`` is not a rung (case-insensitive) or ``"rung_origin"``
            is not one of :data:`GROUP_ORIGINS` or :data:`OLD_ORIGINS` (None counts as
            absent).
    """
    origin = current_origin(group.get(ORIGIN_KEY))
    if origin is not None and origin not in GROUP_ORIGINS:
        raise ValueError(
            f"{where}['{ORIGIN_KEY}']={origin!r} is not an origin; accepted values: "
            f"{', '.join(GROUP_ORIGINS)} (leave it out to pin the group's '{RUNG_KEY}')"
        )
    if RUNG_KEY not in group:
        return None
    rung = parse_rung(group[RUNG_KEY], f"{where}['{RUNG_KEY}']")
    return rung if origin in (None, GROUP_PIN_ORIGIN) else None
