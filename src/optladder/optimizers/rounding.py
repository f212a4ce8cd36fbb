"""Counter-based random bits and stochastic rounding from float32 to bfloat16.

This module *defines* the random bits of the bf16 rung. Every backend (this eager
reference, the CPU kernel, the Triton kernel) must produce exactly these bits, so that a
run is reproducible bit for bit across backends and across a save/resume.

The bits for element ``i`` (row-major index into the flattened parameter) of parameter
number ``param_index`` (its position in the optimizer's ``param_groups``, counted over all
groups) at optimizer step ``step`` (1-based, the step being computed) under ``seed`` are::

    key  = element_key(seed, step, param_index)        # one 32-bit word per (seed, step, param)
    bits = hash32((i + key) mod 2**32)                 # one 32-bit word per element
    exp_avg    rounds with the low 16 bits  (bits & 0xFFFF)
    exp_avg_sq rounds with the high 16 bits (bits >> 16)

``hash32`` is Chris Wellons' "lowbias32" integer hash (a xorshift-multiply finalizer with
measured bias 0.17, https://nullprogram.com/blog/2018/07/31/). It is cheap in C, Triton and
torch, and needs no state: a counter-based generator in the sense of Salmon et al.,
"Parallel random numbers: as easy as 1, 2, 3" (SC 2011). Element indices wrap modulo
2**32, so a single tensor of more than 4,294,967,296 elements reuses bits.

Stochastic rounding to bfloat16 (Gupta et al., "Deep learning with limited numerical
precision", ICML 2015): add 16 uniform random bits to the low half of the float32 bit
pattern and truncate the low half. A value that lies a fraction ``f`` of the way from one
bf16 neighbour to the next rounds up with probability ``f``, so the rounding is unbiased.
NaN stays NaN, infinities stay infinite, and values past the largest bf16 round to inf
with the probability of their distance.
"""

from __future__ import annotations

from typing import Literal

import torch

MASK32 = 0xFFFFFFFF
"""Mask that keeps the low 32 bits of an integer."""

_GOLDEN = 0x9E3779B9  # 2**32 / golden ratio, the usual Weyl-sequence increment
_M1 = 0x7FEB352D
_M2 = 0x846CA68B

Rounding = Literal["stochastic", "nearest"]
"""How moments are written back to bfloat16."""


def hash32(x: int) -> int:
    """Lowbias32 hash of one unsigned 32-bit integer.

    Args:
        x: an integer; only its low 32 bits are used.

    Returns:
        An integer in ``[0, 2**32)``.
    """
    x &= MASK32
    x ^= x >> 16
    x = (x * _M1) & MASK32
    x ^= x >> 15
    x = (x * _M2) & MASK32
    x ^= x >> 16
    return x


def check_seed(seed: object) -> None:
    """Raise unless ``seed`` is an integer in ``[0, 2**64)`` (a bool is not a seed).

    Raises:
        ValueError: naming ``seed``, its value and the allowed range.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")


def check_rounding(rounding: object) -> None:
    """Raise unless ``rounding`` is exactly ``"stochastic"`` or ``"nearest"`` (a str,
    case-sensitive: the engines compare with ``== "stochastic"``, so any other spelling
    would silently mean round-to-nearest).

    Raises:
        ValueError: naming ``rounding``, its value and the allowed values.
    """
    if not isinstance(rounding, str) or rounding not in ("stochastic", "nearest"):
        raise ValueError(f"rounding must be 'stochastic' or 'nearest', got {rounding!r}")


def _mix(a: int, b: int) -> int:
    return hash32(((a * _GOLDEN) & MASK32) ^ (b & MASK32))


def element_key(seed: int, step: int, param_index: int) -> int:
    """The 32-bit key shared by all elements of one parameter at one step.

    Args:
        seed: the optimizer's seed, ``0 <= seed < 2**64``.
        step: the 1-based step being computed, ``0 <= step < 2**32``.
        param_index: the parameter's position over all param groups, ``>= 0``.

    Returns:
        An integer in ``[0, 2**32)``.

    Raises:
        ValueError: if an argument is out of range.
    """
    check_seed(seed)
    if not 0 <= step < 2**32:
        raise ValueError(f"step must be in [0, 2**32), got {step}")
    if param_index < 0:
        raise ValueError(f"param_index must be >= 0, got {param_index}")
    k = _mix(0x5EED, seed & MASK32)
    k = _mix(k, seed >> 32)
    k = _mix(k, step)
    k = _mix(k, param_index & MASK32)
    return _mix(k, param_index >> 32)


def hash32_tensor(x: torch.Tensor) -> torch.Tensor:
    """Elementwise :func:`hash32` of an int64 tensor holding values in ``[0, 2**32)``.

    Args:
        x: int64 tensor of any shape.

    Returns:
        int64 tensor of the same shape, values in ``[0, 2**32)``. The products stay
        exact because int64 multiplication wraps modulo 2**64 and only the low 32 bits
        are kept.
    """
    x = x ^ (x >> 16)
    x = (x * _M1) & MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & MASK32
    return x ^ (x >> 16)


def random_bits(numel: int, key: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 32 random bits of every element of one parameter, as int64 in ``[0, 2**32)``.

    Args:
        numel: number of elements of the parameter.
        key: :func:`element_key` for this (seed, step, parameter).
        device: where to make the tensor.

    Returns:
        int64 tensor of shape ``(numel,)``.
    """
    idx = torch.arange(numel, dtype=torch.int64, device=device)
    return hash32_tensor((idx + key) & MASK32)


def stochastic_round_bf16(x: torch.Tensor, bits16: torch.Tensor) -> torch.Tensor:
    """Round float32 values to bfloat16 using the given 16 random bits per element.

    Args:
        x: float32 tensor, any shape.
        bits16: integer tensor with ``x.numel()`` values in ``[0, 65536)``, in the
            row-major order of ``x``.

    Returns:
        bfloat16 tensor shaped like ``x`` (contiguous).

    Raises:
        TypeError: if ``x`` is not float32.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    as_int = x.contiguous().view(torch.int32).reshape(-1)
    # int32 addition wraps; only NaN bit patterns (>= 0x7FFF0001) can carry into the sign.
    rounded = (as_int + bits16.reshape(-1).to(torch.int32)) & -65536  # clear the low 16 bits
    # Keep NaN payloads NaN: a carry could otherwise turn 0x7FFFxxxx into a negative zero.
    rounded = torch.where(torch.isnan(x.reshape(-1)), as_int & -65536 | 0x00400000, rounded)
    return rounded.view(torch.float32).to(torch.bfloat16).reshape(x.shape)


def round_moments(
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    key: int,
    rounding: Rounding,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Round the float32 moments of one parameter to bfloat16.

    Args:
        exp_avg: float32 first moment, any shape.
        exp_avg_sq: float32 second moment, same shape.
        key: :func:`element_key` for this (seed, step, parameter); unused for
            ``"nearest"``.
        rounding: ``"stochastic"`` (the bits documented above) or ``"nearest"``
            (round-to-nearest-even, torch's ``.to(torch.bfloat16)``).

    Returns:
        ``(exp_avg, exp_avg_sq)`` as bfloat16 tensors of the input shape.
    """
    if rounding == "nearest":
        return exp_avg.to(torch.bfloat16), exp_avg_sq.to(torch.bfloat16)
    bits = random_bits(exp_avg.numel(), key, exp_avg.device)
    return (
        stochastic_round_bf16(exp_avg, bits & 0xFFFF),
        stochastic_round_bf16(exp_avg_sq, bits >> 16),
    )
