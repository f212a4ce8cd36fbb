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

Low-precision params (bfloat16, float16) are written back with stochastic rounding too
(``param_rounding="stochastic"``, the default; ``"nearest"`` is round-to-nearest-even),
from the same hash on a distinct stream::

    pbits = hash32((i + param_key(key)) mod 2**32)     # param_key(key) = mix(key, PARAM_STREAM)
    bfloat16 params round with pbits & 0xFFFF, float16 params with all 32 bits
    (:func:`stochastic_round_f16`)

Without it an update smaller than half a param ulp is lost every step (Zamirai et al.,
"Revisiting BFloat16 Training", 2020; Gupta et al. above).
"""

from __future__ import annotations

from typing import Literal

import torch

MASK32 = 0xFFFFFFFF
"""Mask that keeps the low 32 bits of an integer."""

_GOLDEN = 0x9E3779B9  # 2**32 / golden ratio, the usual Weyl-sequence increment
_M1 = 0x7FEB352D
_M2 = 0x846CA68B

PARAM_STREAM = 0x1B873593
"""Mixed into a param's moment key to give its param writes their own stream of bits."""

Rounding = Literal["stochastic", "nearest"]
"""How moments (``rounding``) and low-precision params (``param_rounding``) are written."""


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


def check_param_rounding(param_rounding: object) -> None:
    """Raise unless ``param_rounding`` is ``"stochastic"`` or ``"nearest"`` (exactly).

    Raises:
        ValueError: naming ``param_rounding``, its value and the allowed values.
    """
    if not isinstance(param_rounding, str) or param_rounding not in ("stochastic", "nearest"):
        raise ValueError(
            f"param_rounding must be 'stochastic' or 'nearest', got {param_rounding!r}"
        )


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
    if param_index < 0:
        raise ValueError(f"param_index must be >= 0, got {param_index}")
    return index_key(step_key(seed, step), param_index)


def step_key(seed: int, step: int) -> int:
    """The part of :func:`element_key` shared by all params at one step (computed once per
    step; the kernels finish the key per param with :func:`index_key`).

    Raises:
        ValueError: if ``seed`` or ``step`` is out of range.
    """
    check_seed(seed)
    return step_key_from_prefix(seed_prefix(seed), step)


def seed_prefix(seed: int) -> int:
    """The part of :func:`element_key` fixed by the seed (what the kernels' op takes as
    ``seed_key``).

    ``element_key`` mixes 0x5EED, the seed's low and high words, the step and the param
    index's low and high words, in that order; the kernels mix the last three.

    Args:
        seed: ``0 <= seed < 2**64`` (not checked here: :func:`step_key` checks it).

    Returns:
        An integer in ``[0, 2**32)``.
    """
    return _mix(_mix(0x5EED, seed & MASK32), seed >> 32)


def step_key_from_prefix(prefix: int, step: int) -> int:
    """:func:`step_key` from the seed's part of it (:func:`seed_prefix`) and the
    1-based step.

    Raises:
        ValueError: if ``step`` is outside ``[0, 2**32)``.
    """
    if not 0 <= step < 2**32:
        raise ValueError(f"step must be in [0, 2**32), got {step}")
    return _mix(prefix, step)


def index_key(step_key_: int, param_index: int) -> int:
    """:func:`element_key` from its :func:`step_key` and the param's index (``>= 0``)."""
    return _mix(_mix(step_key_, param_index & MASK32), param_index >> 32)


def param_key(key: int) -> int:
    """The key of a param's own writes (its stochastic rounding), from its moments' key."""
    return _mix(key, PARAM_STREAM)


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
    rounded = as_int + bits16.reshape(-1).to(torch.int32)
    # Keep NaN payloads NaN: a carry could otherwise turn 0x7FFFxxxx into a negative zero,
    # and clearing the low half could turn a NaN into an infinity.
    rounded = torch.where(torch.isnan(x.reshape(-1)), as_int | 0x00400000, rounded)
    # the high half, as bits: torch's float -> bfloat16 conversion would replace NaNs
    return (rounded >> 16).to(torch.int16).view(torch.bfloat16).reshape(x.shape)


def nearest_round_bf16(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values to bfloat16, to nearest even; every NaN becomes ``0x7FC0``.

    The bits of the kernels' nearest writes (``ol_bf16_ne`` in C, ``_round_bf16`` in
    Triton) and of c10's scalar ``round_to_nearest_even``: ``(u + 0x7FFF + bit 16) >> 16``
    for numbers and infinities, the positive quiet NaN ``0x7FC0`` for any NaN. torch's
    own ``.to(torch.bfloat16)`` gives the same bits for every non-NaN value but not one
    NaN pattern for all devices and code paths (its vectorized CPU conversion writes
    ``0xFFFF``), so the oracle does not use it.

    Args:
        x: float32 tensor, any shape.

    Returns:
        bfloat16 tensor shaped like ``x`` (contiguous).

    Raises:
        TypeError: if ``x`` is not float32.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    u = x.contiguous().view(torch.int32).reshape(-1)
    # int32 addition wraps like the kernels' uint32; only NaN patterns carry into the sign
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    rounded = torch.where(torch.isnan(x.reshape(-1)), 0x7FC0, rounded)
    return rounded.to(torch.int16).view(torch.bfloat16).reshape(x.shape)


def stochastic_round_f16(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Round float32 values to float16 using 32 random bits per element.

    The float16 grid is uniform within a binade and has the fixed quantum 2**-24 below
    2**-14 (subnormals), so: ``|x| >= 2**-14`` adds the low 13 random bits to the low 13
    bits of the float32 pattern and clears them; ``2**-24 <= |x| < 2**-14`` does the same
    with ``126 - biased exponent`` bits (up to 23); a smaller ``|x|`` becomes ``2**-24``
    when ``bits >> 8 < |x| * 2**48`` (probability ``|x| / 2**-24`` to 24 bits), else 0.
    The rounded value is a float16 value, so the conversion is exact; values past 65504
    round to inf with the probability of their distance, NaN becomes ``0x7E00`` with
    its sign.

    Args:
        x: float32 tensor, any shape.
        bits: integer tensor with ``x.numel()`` values in ``[0, 2**32)``, row-major.

    Returns:
        float16 tensor shaped like ``x`` (contiguous).

    Raises:
        TypeError: if ``x`` is not float32.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    r = bits.reshape(-1).to(torch.int64)
    u = x.contiguous().view(torch.int32).reshape(-1).to(torch.int64) & MASK32
    a, s = u & 0x7FFFFFFF, u & 0x80000000
    e = a >> 23
    mask = (torch.ones_like(e) << (126 - e).clamp(13, 23)) - 1
    big = (a + (r & mask)) & ~mask
    t = a.to(torch.int32).view(torch.float32) * 2.0**48  # exact: a power-of-two scale
    tiny = torch.where((r >> 8).to(torch.float32) < t, 0x33800000, 0)
    y = (s | torch.where(e >= 103, big, tiny)).to(torch.int32)  # wraps, as in C
    h = y.view(torch.float32).to(torch.float16).view(torch.int16)
    nan = ((s >> 16) | 0x7E00).to(torch.int16)
    return torch.where(a > 0x7F800000, nan, h).view(torch.float16).reshape(x.shape)


def round_param(
    x: torch.Tensor, dtype: torch.dtype, key: int, param_rounding: Rounding
) -> torch.Tensor:
    """Round a param's new float32 value to its storage ``dtype`` (the oracle's write).

    Args:
        x: float32 tensor, the updated param.
        dtype: the param's dtype; float32 (and wider) is returned unrounded.
        key: :func:`element_key` of this (seed, step, param); the param's bits come from
            :func:`param_key` of it.
        param_rounding: ``"stochastic"`` or ``"nearest"`` (round-to-nearest-even:
            :func:`nearest_round_bf16` for bfloat16, torch's ``.to(torch.float16)``).

    Returns:
        A tensor of ``dtype`` shaped like ``x``.
    """
    if dtype == torch.bfloat16 and param_rounding == "nearest":
        return nearest_round_bf16(x)
    if dtype not in (torch.bfloat16, torch.float16) or param_rounding == "nearest":
        return x.to(dtype)
    bits = random_bits(x.numel(), param_key(key), x.device)
    if dtype == torch.bfloat16:
        return stochastic_round_bf16(x, bits & 0xFFFF)
    return stochastic_round_f16(x, bits)


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
            (round-to-nearest-even, :func:`nearest_round_bf16`).

    Returns:
        ``(exp_avg, exp_avg_sq)`` as bfloat16 tensors of the input shape.
    """
    if rounding == "nearest":
        return nearest_round_bf16(exp_avg), nearest_round_bf16(exp_avg_sq)
    bits = random_bits(exp_avg.numel(), key, exp_avg.device)
    return (
        stochastic_round_bf16(exp_avg, bits & 0xFFFF),
        stochastic_round_bf16(exp_avg_sq, bits >> 16),
    )
