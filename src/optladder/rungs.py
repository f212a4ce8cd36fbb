"""The rungs of the ladder and what a device's kernels can do for each: plain data.

This module sits below ``policies`` and ``optimizers``; both import it, it imports
neither.
"""

from __future__ import annotations

from typing import Literal

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
