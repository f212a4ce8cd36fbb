"""The rungs of the ladder and what a device's kernels can do for each: plain data.

This module sits below ``policies`` and ``optimizers``; both import it, it imports
neither.
"""

from __future__ import annotations

from collections.abc import Mapping
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

BNB_DTYPES = ("float32", "bfloat16", "float16")
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
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: str
    fused: dict[Rung, bool]
    unfused_reasons: dict[Rung, str] = Field(default_factory=dict)
    available: dict[Rung, bool] = Field(default_factory=lambda: dict.fromkeys(RUNGS, True))
    unavailable_reasons: dict[Rung, str] = Field(default_factory=dict)
    slow: dict[Rung, str] = Field(default_factory=dict)


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


Origin = Literal["policy", "forced", "pinned", "escalated", "checkpoint"]
"""How a decision's rung was reached (``Decision.origin``)."""
GROUP_ORIGINS: tuple[str, ...] = (*get_args(Origin), GROUP_PIN_ORIGIN)
"""The values ``ORIGIN_KEY`` may hold in a param group."""


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
            is not one of :data:`GROUP_ORIGINS` (None counts as absent).
    """
    origin = group.get(ORIGIN_KEY)
    if origin is not None and origin not in GROUP_ORIGINS:
        raise ValueError(
            f"{where}['{ORIGIN_KEY}']={origin!r} is not an origin; accepted values: "
            f"{', '.join(GROUP_ORIGINS)} (leave it out to pin the group's '{RUNG_KEY}')"
        )
    if RUNG_KEY not in group:
        return None
    rung = parse_rung(group[RUNG_KEY], f"{where}['{RUNG_KEY}']")
    return rung if origin in (None, GROUP_PIN_ORIGIN) else None
