"""The CPU kernel of the 8bit rung: AdamW on bitsandbytes' block-wise 8-bit state.

The C loop (:mod:`._cpu8bit_source`) is compiled into a shared object of its own on the
first 8-bit CPU step (about 17 seconds with gcc 12 on one core: a scalar loop
per instruction set and the AVX-512 path, for each param/grad dtype pair), by
:func:`optladder.optimizers.kernels.cpu.load_source` (the bf16 kernel's compiler, flags,
private cache and loader). A step is two calls:

- :func:`prepare_table` (the prepare phase): checks every param's state, and writes the
  ctypes tables the C loop reads (one row per param: pointers and the scalars of its
  step; one row per work item of up to 512 blocks). Everything a step allocates is
  allocated here.
- :func:`run_table` (the commit phase): one C call over all params, writing params and
  state in place; it allocates nothing.

State layout (bitsandbytes' ``AdamW8bit``, which these tables point into): a param of at
least ``min_8bit_size`` elements has ``state1`` / ``state2`` uint8 codes of its shape,
``qmap1`` / ``qmap2`` the 256-value code books (signed and unsigned dynamic maps) and
``absmax1`` / ``absmax2`` one float32 per started 256-element block; a smaller one has
float32 ``state1`` / ``state2``. Per element a step reads and writes 2 code bytes plus
the param and grad (10 bytes with float32 params and grads, against 28 for torch's fused
float32 AdamW), and at most ~8 KiB of stack per thread (the AVX-512 path: the block's
moments, the code books' byte planes and the encoder's tables); no float32 copy of any
tensor.

Update rule: bitsandbytes' CPU fallback for ``"adam"`` (``backends/cpu/ops.py``:
``_optimizer_update_8bit_blockwise_cpu`` for 8-bit state, ``_optimizer_update_32bit_cpu``
for float32 state), with its scalars rounded to float32 as torch rounds them. Encoding:
nearest code, ties to the lower one, as bitsandbytes' torch backend's
``quantize_blockwise`` (see :func:`code_bounds`).
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from optladder.optimizers.kernels import cpu
from optladder.optimizers.kernels._cpu8bit_source import SOURCE

BLOCK_SIZE = 256
"""Elements per quantization block (bitsandbytes' optimizer block size)."""

PARAM_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
}
"""Param and grad dtypes the kernel reads and writes, and their codes in the C struct."""

_BLOCKS_PER_ITEM = 512
"""Blocks per work item: 128Ki elements, 512 KiB of float32 params."""

_MIN_ELEMENTS_PER_THREAD = 1 << 16
"""Below this many elements per thread, starting threads costs more than it saves."""


class _Param(ctypes.Structure):
    _fields_ = (
        ("param", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("state1", ctypes.c_void_p),
        ("state2", ctypes.c_void_p),
        ("absmax1", ctypes.c_void_p),
        ("absmax2", ctypes.c_void_p),
        ("qmap1", ctypes.c_void_p),
        ("qmap2", ctypes.c_void_p),
        ("bounds1", ctypes.c_void_p),
        ("bounds2", ctypes.c_void_p),
        ("table1", ctypes.c_void_p),
        ("table2", ctypes.c_void_p),
        ("numel", ctypes.c_int64),
        ("param_dtype", ctypes.c_int32),
        ("grad_dtype", ctypes.c_int32),
        ("quantized", ctypes.c_int32),
        ("coupled", ctypes.c_int32),
        ("decoupled", ctypes.c_int32),
        ("beta1", ctypes.c_float),
        ("one_minus_beta1", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("one_minus_beta2", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("step_size", ctypes.c_float),
        ("bc2_sqrt", ctypes.c_float),
        ("decay", ctypes.c_float),
        ("weight_decay", ctypes.c_float),
    )


class _Item(ctypes.Structure):
    _fields_ = (
        ("param", ctypes.c_int64),
        ("first_block", ctypes.c_int64),
        ("n_blocks", ctypes.c_int64),
    )


def unavailable_reason() -> str | None:
    """Why the 8-bit CPU kernel cannot run here, or None (it may still need building).

    The same as the bf16 CPU kernel's (:func:`optladder.optimizers.kernels.cpu.
    unavailable_reason`): both libraries are built with the same compiler and cache.
    """
    return cpu.unavailable_reason()


def fallback_reason(why: str) -> str:
    """The sentence saying the 8bit rung leaves this kernel for bitsandbytes' CPU path
    because of ``why``; one wording for the decision and for the engine's per-param
    reasons, so a run logs it once."""
    return f"{why}; the 8bit rung runs bitsandbytes' per-tensor CPU fallback"


STEM = "adamw8bit"
"""The 8-bit kernel library's file name in the cache, before the source's hash."""
_NAME = "the 8-bit CPU kernel"  # in build and load errors


def build() -> Path:
    """Compile the 8-bit kernel's library into the private cache unless a verified build
    is there (as :func:`optladder.optimizers.kernels.cpu.build` does for the bf16 kernel).

    Returns:
        Path of the shared object.

    Raises:
        KernelBuildError: with the compiler's message when the build fails, or when the
            cache folder cannot be used safely.
    """
    return cpu.build_source(STEM, SOURCE, _NAME)


@functools.cache
def load_library() -> ctypes.CDLL:
    """Build (first use only) and load the CPU kernels' library, declaring the 8-bit
    kernel's C signature.

    Raises:
        KernelBuildError: if the library cannot be built or loaded, or its 8-bit kernel's
            tables have another layout than this module's (a stale build).
    """
    lib = cpu.load_source(STEM, SOURCE, _NAME)
    try:
        step = lib.ol_adamw8bit_step
        sizes = (lib.ol_adamw8bit_param_size(), lib.ol_adamw8bit_item_size())
    except AttributeError as exc:
        raise cpu.KernelBuildError(f"the CPU kernels' library has no 8-bit kernel: {exc}") from exc
    expected = (ctypes.sizeof(_Param), ctypes.sizeof(_Item))
    if sizes != expected:
        raise cpu.KernelBuildError(
            f"the 8-bit CPU kernel's table rows are {sizes} bytes, this module writes {expected}"
        )
    step.argtypes = (
        ctypes.POINTER(_Param),
        ctypes.POINTER(_Item),
        ctypes.c_int64,
        ctypes.c_int32,
        ctypes.c_int32,
    )
    step.restype = ctypes.c_int
    lib.ol_quantize_blockwise.argtypes = (
        ctypes.c_void_p,
        ctypes.c_int32,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int32,
        ctypes.c_int32,
    )
    lib.ol_quantize_blockwise.restype = ctypes.c_int
    lib.ol_adamw8bit_simd.argtypes = ()
    lib.ol_adamw8bit_simd.restype = ctypes.c_int
    return lib


SIMD_SCALAR = 0
"""``simd`` level of :func:`run_table` and :func:`quantize_blockwise`: the scalar loops."""
SIMD_AVX2 = 1
"""``simd`` level: whole blocks on the AVX2 path at most (8 lanes; needs FMA and F16C)."""
SIMD_AVX512 = 2
"""``simd`` level: whole blocks on the AVX-512 path (16 lanes; needs AVX-512 F, BW, DQ,
VL and VBMI), else the best the CPU has."""


def simd_available() -> bool:
    """Whether this CPU runs a SIMD path of the 8-bit kernel, as the kernel reads it with
    gcc's ``__builtin_cpu_supports``: with AVX-512 (f/bw/dq/vl/vbmi) whole 256-element
    blocks run on 16 lanes, with AVX2 (and FMA, F16C) on 8 lanes; without either every
    block takes the scalar loops. Every path writes the same bits.

    Raises:
        KernelBuildError: if the kernel cannot be built or loaded.
    """
    return simd_level() > SIMD_SCALAR


def simd_level() -> int:
    """The best SIMD path of the 8-bit kernel on this CPU: :data:`SIMD_AVX512`,
    :data:`SIMD_AVX2` or :data:`SIMD_SCALAR` (see :func:`simd_available`).

    Raises:
        KernelBuildError: if the kernel cannot be built or loaded.
    """
    return int(load_library().ol_adamw8bit_simd())


def _simd_arg(simd: bool | int) -> int:
    """The C kernel's ``simd`` argument, the highest path it may take: True is the best
    the CPU has, False the scalar loops, an int a level (:data:`SIMD_AVX2`, ...) that the
    kernel lowers to what the CPU has."""
    if isinstance(simd, bool):
        return SIMD_AVX512 if simd else SIMD_SCALAR
    return max(SIMD_SCALAR, min(int(simd), SIMD_AVX512))


def quantize_blockwise(
    values: torch.Tensor,
    qmap: torch.Tensor,
    *,
    start_table: torch.Tensor | None = None,
    simd: bool | int = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``values`` in bitsandbytes' block-wise format with the kernel's rule.

    The same encoding as the kernel's step (nearest code of ``qmap``, ties to the lower
    one; see :func:`code_bounds`), so a moment converted to 8 bits (a migration, a load)
    holds the codes the kernel would write, and an exact 0 stays exactly 0. Allocates
    only the results and the 1 KiB :func:`code_bounds` table (it searches the bounds
    without the step's start table), so a migration's peak stays one param's new state.

    Args:
        values: float32, bfloat16 or float16 CPU tensor, any shape.
        qmap: the code book (see :func:`code_bounds`).
        start_table: :func:`code_table` of ``code_bounds(qmap)``, to encode as the step
            does (a table lookup and one comparison, on AVX-512 or AVX2 lanes where the
            CPU has them); default None: a binary search on the bounds. Same codes either way.
        simd: False keeps to the scalar loop (same codes; for tests); a level such as
            :data:`SIMD_AVX2` caps the path (tests and benchmarks of each path).

    Returns:
        ``(codes, absmax)``: uint8 codes of ``values``' shape, float32 absmax with one
        value per started 256-element block. As in bitsandbytes' torch backend, a whole
        block is scaled by ``x * (1 / max(absmax, 1e-38))`` and a partial last block by
        ``x / max(absmax, 1e-38)``, whose absmax is written clamped to 1e-38.

    Raises:
        ValueError: for another dtype or device, or a bad code book.
        KernelBuildError: if the kernel cannot be built or loaded.
    """
    if values.dtype not in PARAM_DTYPE_CODES or values.device.type != "cpu":
        raise ValueError(
            "values must be a float32, bfloat16 or float16 CPU tensor, got "
            f"{values.dtype} on {values.device}"
        )
    lib = load_library()
    bounds = code_bounds(qmap)  # without start_table: a binary search on these
    src = values.contiguous()
    codes = torch.empty(values.shape, dtype=torch.uint8)
    absmax = torch.empty(_ceil_div(src.numel(), BLOCK_SIZE), dtype=torch.float32)
    threads = max(1, min(torch.get_num_threads(), src.numel() // _MIN_ELEMENTS_PER_THREAD))
    lib.ol_quantize_blockwise(
        src.data_ptr(),
        PARAM_DTYPE_CODES[src.dtype],
        src.numel(),
        None if start_table is None else start_table.data_ptr(),
        bounds.data_ptr(),
        codes.data_ptr(),
        absmax.data_ptr(),
        threads,
        _simd_arg(simd),
    )
    return codes, absmax


def code_bounds(qmap: torch.Tensor) -> torch.Tensor:
    """The encoding table of a code book: the 255 midpoints of adjacent codes, then +inf.

    A value ``x`` (scaled by the block's absmax into [-1, 1]) is encoded as the number of
    midpoints below it, i.e. the nearest code with ties to the lower one: bitsandbytes'
    reference rule (``torch.bucketize`` on ``(code[:-1] + code[1:]) / 2`` in its torch
    backend; its CUDA kernel also picks the nearest code). The midpoints are computed in
    float32 as bitsandbytes computes them.

    One exception, for books whose first code is 0 (the unsigned map of ``exp_avg_sq``):
    a positive value is encoded as the smallest positive code rather than as 0 (the
    first bound is 0). A second moment rounded to 0 under a first moment that is not
    would make the next update ``m / (sqrt(v) + eps)`` blow up to ``m / eps``, moving
    such params by up to ``lr * 1e5`` (measured on heavy-tailed grads);
    bitsandbytes' native CPU quantizer never encodes a positive value as 0 either. An
    exact 0 stays 0.

    Args:
        qmap: the code book, 256 float32 values in ascending order (bitsandbytes'
            ``create_dynamic_map``, signed or unsigned), on the CPU.

    Returns:
        float32 CPU tensor of 256 elements, contiguous.

    Raises:
        ValueError: if ``qmap`` is not 256 finite ascending float32 values on the CPU.
    """
    if qmap.dtype != torch.float32 or qmap.shape != (256,) or qmap.device.type != "cpu":
        raise ValueError(
            "a code book (qmap) must be 256 float32 values on the CPU, got "
            f"{qmap.dtype} of shape {tuple(qmap.shape)} on {qmap.device}"
        )
    if not bool(torch.isfinite(qmap).all()) or not bool((qmap[1:] >= qmap[:-1]).all()):
        raise ValueError("a code book (qmap) must hold finite values in ascending order")
    bounds = torch.empty(256, dtype=torch.float32)
    torch.add(qmap[:-1], qmap[1:], out=bounds[:255]).div_(2)
    bounds[255] = math.inf
    if qmap[0] == 0:  # an unsigned book: a positive value is never encoded as 0
        bounds[0] = 0.0
    return bounds


_ONE_PREFIX = 0x3F80
"""The top 15 magnitude bits (exponent and 7 mantissa bits) of 1.0."""

VECTOR_TABLE_WORDS = 162
"""int32 words of the AVX-512 encoder's tables at the end of a :func:`code_table`."""

_LOWEST_SLOT = 96
"""The smallest exponent the AVX-512 encoder's slots take (a slot is the exponent's low 5
bits, so the exponents from the smallest slot to 1.0's, 127, must span at most 32)."""


def code_table(bounds: torch.Tensor) -> torch.Tensor:
    """The encoder's start table: for a float32 ``x`` in [-1, 1], the number of ``bounds``
    below it in one lookup and one comparison (no search).

    Buckets are the floats sharing their top 16 bits (sign, exponent, 7 mantissa bits),
    clamped below to the prefix ``lo - 1`` (bucket 0: every magnitude under ``lo``, the
    smallest prefix of a non-zero bound) and above to the prefix of 1.0 (NaN falls there
    and counts no bound). Each bucket holds at most one bound, so the count is the
    bounds below the bucket's smallest float plus one comparison with the bound inside.

    Layout (int32): ``[lo, w, bits of bucket 0's bound for x >= +0 (0.0 or +inf), -1 if
    any bound is negative else 0]``, then ``w`` entries for ``x >= +0`` and ``w`` for
    ``x <= -0`` (only the first is read when no bound is negative). Entry = count | low16
    << 8: the count, and the low 16 bits of the bound inside the bucket (of the bucket's
    largest float where none is, so that the comparison never counts it). Then the
    :data:`VECTOR_TABLE_WORDS` words of the AVX-512 encoder's tables (see
    :func:`_vector_tables`; all 0 for a book they cannot serve). For bitsandbytes'
    dynamic maps ``lo`` is near 2**-21 and a table is about 22 KiB.

    Args:
        bounds: from :func:`code_bounds`.

    Returns:
        int32 CPU tensor of ``4 + 2 * w + VECTOR_TABLE_WORDS`` elements.

    Raises:
        ValueError: if a bucket holds more than one bound (a code book denser than
            bitsandbytes' 8-bit dynamic maps, which have at most one per bucket), e.g.
            two or more bounds equal to 0 (a book with repeated zero codes): such books
            are stepped by bitsandbytes' own per-tensor path.
    """
    edges = bounds[:255]
    bits = edges.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    mags = (bits >> 16) & 0x7FFF
    nonzero = mags[edges != 0]
    lo = int(nonzero.min()) if nonzero.numel() else _ONE_PREFIX
    lo = max(1, min(lo, _ONE_PREFIX))
    width = _ONE_PREFIX - lo + 2
    prefix = torch.arange(lo - 1, _ONE_PREFIX + 1, dtype=torch.int64)  # bucket j: lo - 1 + j
    # the smallest and the largest float of each bucket, positive then negative
    pos_lo = torch.cat([torch.zeros(1, dtype=torch.int64), prefix[1:] << 16])
    pos_hi = (prefix << 16) | 0xFFFF
    pos_hi[-1] = _ONE_PREFIX << 16  # 1.0: the largest value the last bucket takes
    neg_lo = ((prefix | 0x8000) << 16) | 0xFFFF
    neg_hi = torch.cat([torch.tensor([0x8000 << 16]), (prefix[1:] | 0x8000) << 16])

    smallest = _as_float(torch.cat([pos_lo, neg_lo]))
    largest = _as_float(torch.cat([pos_hi, neg_hi]))
    start = torch.searchsorted(edges, smallest, side="left")
    inside = torch.searchsorted(edges, largest, side="right") - start
    zeros = int((edges == 0).sum())
    if zeros > 1:  # bucket 0's one comparison counts one of them
        raise ValueError(
            f"a code book has {zeros} midpoints equal to 0 (repeated zero codes, as in "
            "bitsandbytes' maps of fewer than 8 bits); the 8-bit CPU kernel takes books "
            "with at most one"
        )
    if int(inside.max()) > 1:
        raise ValueError(
            "a code book has 2 or more midpoints among floats sharing their top 16 bits; "
            "the 8-bit CPU kernel takes books as sparse as bitsandbytes' dynamic maps"
        )
    if bool((edges[(mags < lo)] != 0).any()):  # only 0 may lie in bucket 0 (lo's definition)
        raise ValueError("a code book has a non-zero midpoint under its smallest prefix")
    zero_buckets = torch.tensor([0, width])
    # the low 16 bits of the bound inside each bucket, else of its largest float
    low = torch.where(
        inside > 0, bits[start.clamp(max=254)] & 0xFFFF, torch.cat([pos_hi, neg_hi]) & 0xFFFF
    )
    low[zero_buckets] = 0  # bucket 0's bound comes from the header
    has_zero = bool((edges == 0).any())
    zero_bits = 0 if has_zero else 0x7F800000  # 0.0 or +inf
    negative = -1 if bool((edges < 0).any()) else 0
    head = torch.tensor([lo, width, zero_bits, negative], dtype=torch.int64)
    entries = torch.cat([head, start.clamp(max=255) | (low << 8)]).to(torch.int32)
    return torch.cat([entries, _vector_tables(bounds)])


def _vector_tables(bounds: torch.Tensor) -> torch.Tensor:
    """The AVX-512 encoder's tables (``ol8v_quantize64``): the same count of ``bounds``
    below a float32 ``x`` in [-1, 1] (or NaN, counted 255) as :func:`code_table`'s, from
    the top 16 bits of ``x`` by register permutes, without memory lookups.

    Buckets: per sign and exponent ``e`` of ``x``, the floats sharing the top ``7 - s``
    of their 7 top mantissa bits ``m7``, ``key = base + (m7 >> s)``, with ``s`` per sign
    and exponent the largest (0 to 7) whose buckets each hold at most one bound. Every
    exponent under ``E0 + 1`` is one bucket (``E0`` is one under the smallest exponent
    of a non-zero bound: only a bound of 0 can lie there). ``e = 127`` holds ±1.0 (x is
    clamped, or at most a step over) and, in the keys of ``m7 >= 64``, NaN: the encoder
    reads ``e & 31``,
    and a NaN, quiet after the scaling, has ``e = 255`` and ``m7 >= 64``; NaN's keys count
    255. Per key, ``c0``: the bounds below the bucket's smallest float; the code is then
    ``c0 + (bounds[c0] < x)`` (``bounds[c0]`` is the bound inside the bucket, or one
    above it; ``bounds[255]`` is +inf).

    Layout (int32, :data:`VECTOR_TABLE_WORDS` words): ``[1, E0]``, then 64 uint16
    (``base | s << 9`` for ``x >= +0`` at ``e & 31``, then 32 for ``x <= -0``), then 512
    uint8 (``c0`` per key), in little-endian order. All 0 (the kernel then encodes with
    the start table) where a book needs more than 512 keys, has a bound of -0.0, a bound
    outside (-1, 1) (the encoder leaves blocks with a finite absmax unclamped, whose
    values may pass ±1 by a float32 step) or a non-zero bound under ``2**-31`` (``E0 <
    96``), or has no room for 1.0 alone in its top exponent's buckets (``s <= 6``).
    bitsandbytes' signed dynamic map takes 438 keys, the unsigned one 464.

    Args:
        bounds: from :func:`code_bounds` (255 ascending midpoints, then +inf).

    Returns:
        int32 CPU tensor of :data:`VECTOR_TABLE_WORDS` elements.
    """
    none = torch.zeros(VECTOR_TABLE_WORDS, dtype=torch.int32)
    edges = bounds[:255]
    bits = edges.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    if not bool(bounds[255] == math.inf) or bool((bits == 0x80000000).any()):
        return none
    if not bool((edges.abs() < 1).all()):  # see above: unclamped values
        return none
    exps = bits[edges != 0] >> 23 & 0xFF
    e0 = (min(int(exps.min()), 127) if exps.numel() else 127) - 1
    if e0 < _LOWEST_SLOT:
        return none
    # every (shift s, exponent e0 + row, bucket k) at once, k < 128 >> s used: a few dozen
    # tensor ops, not one set per shift and sign (a first step builds these tables, and
    # tests fault every op of a step)
    n_rows = 128 - e0
    sh = torch.arange(8, dtype=torch.int64)[:, None, None]
    e = torch.arange(e0, 128, dtype=torch.int64)[None, :, None]
    k = torch.arange(128, dtype=torch.int64)[None, None, :]
    lo = ((e << 23) | (k << (16 + sh))).expand(8, n_rows, 128).clone()  # magnitude bits
    hi = ((e << 23) | (((k + 1) << (16 + sh)) - 1)).expand(8, n_rows, 128).clone()
    lo[:, 0], hi[:, 0] = 0, ((e0 + 1) << 23) - 1  # every magnitude under 2**(e0 - 126)
    hi[:, -1] = hi[:, -1].clamp(max=_ONE_PREFIX << 16)  # 1.0: the largest x
    skip = torch.zeros(8, n_rows, 128, dtype=torch.bool)
    skip[:, -1] = (k[0] >= (64 >> sh[:, 0])) | (lo[:, -1] > hi[:, -1])  # NaN's keys, no float
    unused = (k >= (128 >> sh)).expand(8, n_rows, 128)
    # per sign: x >= +0, then x <= -0 (whose largest magnitude is its smallest float)
    smallest = torch.stack([_as_float(lo), _as_float(hi | 1 << 31)])
    largest = torch.stack([_as_float(hi), _as_float(lo | 1 << 31)])
    start = torch.searchsorted(edges, smallest.flatten(), side="left").view(smallest.shape)
    end = torch.searchsorted(edges, largest.flatten(), side="right").view(smallest.shape)
    ok = (torch.where(skip | unused, 0, end - start) <= 1).all(dim=-1)  # [sign, s, row]
    ok[:, :7, 0] = False  # under E0 + 1: one bucket
    ok[:, 7, -1] = False  # 1.0's exponent: room for 1.0 alone
    shift = (ok * (sh[:, :, 0] + 1)).amax(dim=1) - 1  # [sign, row]: the largest s that works
    if bool((shift < 0).any()):
        return none
    width = 128 >> shift
    if int(width.sum()) > 512:
        return none
    base = torch.cumsum(width.flatten(), 0) - width.flatten()
    counts = torch.where(skip, 255, start)  # [sign, s, row, k]
    chosen = counts.gather(1, shift[:, None, :, None].expand(2, 1, n_rows, 128))[:, 0]
    keys = chosen[k[0].expand(2, n_rows, 128) < width[:, :, None]]  # sign, row, k order
    slot = torch.zeros(64, dtype=torch.int64)
    places = torch.arange(2)[:, None] * 32 + (torch.arange(e0, 128) & 31)[None, :]
    slot[places.flatten()] = base | shift.flatten() << 9
    c0 = torch.zeros(512, dtype=torch.uint8)
    c0[: keys.numel()] = keys.to(torch.uint8)
    head = torch.tensor([1, e0], dtype=torch.int32)
    return torch.cat([head, slot.to(torch.int16).view(torch.int32), c0.view(torch.int32)])


def book_tables(qmap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`code_bounds` and :func:`code_table` of a code book, made once per process
    for each distinct book (by its float32 bits; the last 16 kept) and shared: every
    8bit optimizer steps bitsandbytes' same two dynamic maps, and building their tables
    takes ~2 MiB of temporaries for a moment (so a first step would peak ~2 MiB over its
    state whatever the model's size). Callers must not write to the returned tensors
    (the kernel only reads them).

    Args:
        qmap: the code book, 256 float32 values in ascending order, on the CPU.

    Returns:
        ``(bounds, table)``: float32 of 256 elements and int32 of ``code_table``'s length.

    Raises:
        ValueError: as :func:`code_bounds` and :func:`code_table` raise (not cached).
    """
    if qmap.dtype != torch.float32 or qmap.shape != (256,) or qmap.device.type != "cpu":
        code_bounds(qmap)  # raises its ValueError, naming the book's dtype, shape, device
    return _book_tables(tuple(qmap.detach().view(torch.int32).tolist()))


@functools.lru_cache(maxsize=16)
def _book_tables(bits: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    qmap = torch.tensor(bits, dtype=torch.int32).view(torch.float32)
    edges = code_bounds(qmap)
    return edges, code_table(edges)


def _as_float(b: torch.Tensor) -> torch.Tensor:
    """float32 values of 32-bit patterns held in int64 (0 to 2**32 - 1)."""
    return torch.where(b >= 1 << 31, b - (1 << 32), b).to(torch.int32).view(torch.float32)


def param_unsupported_reason(p: torch.Tensor, grad: torch.Tensor) -> str | None:
    """Why the 8-bit CPU kernel cannot step this param, or None if it can.

    Args:
        p: the param (float32, bfloat16 or float16; CPU; contiguous).
        grad: its grad (one of those dtypes, dense, contiguous, same shape and device).
    """
    if p.device.type != "cpu":
        return f"param is on {p.device}, the 8-bit CPU kernel needs CPU tensors"
    if p.dtype not in PARAM_DTYPE_CODES:
        return f"param dtype {p.dtype}: the 8-bit CPU kernel steps float32, bfloat16, float16"
    if grad.dtype not in PARAM_DTYPE_CODES:
        return f"grad dtype {grad.dtype}: the 8-bit CPU kernel reads float32, bfloat16, float16"
    if grad.is_sparse or grad.device != p.device or grad.shape != p.shape:
        return "grad is sparse, on another device or of another shape"
    if not (p.is_contiguous() and grad.is_contiguous()):
        return "param or grad is not contiguous"
    return None


@dataclass(frozen=True)
class Job:
    """One param for :func:`prepare_table`, in bitsandbytes' ``AdamW8bit`` state layout.

    Attributes:
        param: float32/bfloat16/float16 CPU tensor, contiguous, updated in place.
        grad: float32/bfloat16/float16 tensor of the same shape, contiguous.
        state1: ``exp_avg``: uint8 codes (quantized) or float32, the param's shape,
            contiguous; updated in place.
        state2: ``exp_avg_sq``, as ``state1``.
        absmax1: float32, one per started 256-element block (quantized state), else None.
        absmax2: as ``absmax1``.
        bounds1: :func:`code_bounds` of ``qmap1`` (quantized state), else None.
        bounds2: :func:`code_bounds` of ``qmap2``, else None.
        table1: :func:`code_table` of ``bounds1`` (quantized state), else None.
        table2: :func:`code_table` of ``bounds2``, else None.
        qmap1: the signed code book of ``state1`` (quantized state), else None.
        qmap2: the unsigned code book of ``state2``, else None.
        step: the step this update makes (the param's count after it, ``>= 1``).
        lr: learning rate.
        betas: ``(beta1, beta2)``.
        eps: denominator term.
        weight_decay: decay coefficient.
        coupled_weight_decay: Adam (``grad += wd * param``, computed in float32, the grad
            tensor is not written) instead of AdamW (``param *= 1 - lr * wd``).
    """

    param: torch.Tensor
    grad: torch.Tensor
    state1: torch.Tensor
    state2: torch.Tensor
    absmax1: torch.Tensor | None
    absmax2: torch.Tensor | None
    bounds1: torch.Tensor | None
    bounds2: torch.Tensor | None
    table1: torch.Tensor | None
    table2: torch.Tensor | None
    qmap1: torch.Tensor | None
    qmap2: torch.Tensor | None
    step: int
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    coupled_weight_decay: bool = False


@dataclass(frozen=True)
class Table:
    """The prepared tables of one step (see :func:`prepare_table`).

    Attributes:
        params: one ctypes row per job.
        items: one ctypes row per work item.
        n_items: the number of items.
        threads: worker threads the call will use.
        tensors: every tensor the rows point into, kept alive until the call.
    """

    params: ctypes.Array[_Param]
    items: ctypes.Array[_Item]
    n_items: int
    threads: int
    tensors: tuple[torch.Tensor | None, ...]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_state(k: int, job: Job) -> bool:
    """Check job ``k``'s state tensors; return whether its state is quantized."""
    shape = job.param.shape
    for name in ("state1", "state2"):
        t = getattr(job, name)
        if t.dtype not in (torch.uint8, torch.float32) or t.shape != shape:
            raise ValueError(
                f"jobs[{k}].{name} must be uint8 or float32 of shape {tuple(shape)}, got "
                f"{t.dtype} of shape {tuple(t.shape)}"
            )
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"jobs[{k}].{name} must be a contiguous CPU tensor")
    quantized = job.state1.dtype == torch.uint8
    if job.state2.dtype != job.state1.dtype:
        raise ValueError(
            f"jobs[{k}] has {job.state1.dtype} state1 but {job.state2.dtype} state2; "
            "both are uint8 codes or both float32"
        )
    if quantized:
        blocks = _ceil_div(job.param.numel(), BLOCK_SIZE)
        for name in ("absmax1", "absmax2"):
            t = getattr(job, name)
            if t is None or t.dtype != torch.float32 or t.numel() != blocks:
                raise ValueError(
                    f"jobs[{k}].{name} must be float32 with {blocks} elements (one per "
                    f"started {BLOCK_SIZE}-element block), got "
                    f"{None if t is None else (t.dtype, t.numel())}"
                )
            if not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"jobs[{k}].{name} must be a contiguous CPU tensor")
        for name in ("qmap1", "qmap2", "bounds1", "bounds2", "table1", "table2"):
            t = getattr(job, name)
            if name.startswith("table"):
                ok = t is not None and t.dtype == torch.int32 and t.dim() == 1
                ok = ok and t.numel() >= 6 + VECTOR_TABLE_WORDS
                ok = ok and t.numel() == 4 + 2 * int(t[1]) + VECTOR_TABLE_WORDS
                ok = ok and int(t[1]) == _ONE_PREFIX - int(t[0]) + 2
                if not ok:
                    raise ValueError(f"jobs[{k}].{name} must be a code_table() of its bounds")
            elif t is None or t.dtype != torch.float32 or t.shape != (256,):
                raise ValueError(f"jobs[{k}].{name} must be 256 torch.float32 values")
            if not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"jobs[{k}].{name} must be a contiguous CPU tensor")
    return quantized


def step_rows(count: int) -> ctypes.Array[_Param]:
    """``count`` zeroed param rows of the kernel's table, for :func:`write_step_scalars`
    (a caller that keeps a table between steps writes each step's scalars into rows of
    its own and copies their bytes into the table's rows)."""
    return (_Param * count)()


STEP_SCALAR_FIELDS = (
    "beta1",
    "one_minus_beta1",
    "beta2",
    "one_minus_beta2",
    "bc2_sqrt",
    "eps",
    "step_size",
    "coupled",
    "decoupled",
    "decay",
    "weight_decay",
)
"""The fields of a param row that :func:`write_step_scalars` writes: the same for every
param of one group, state format (quantized or not) and step count."""


def write_step_scalars(
    row: _Param,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    quantized: bool,
    coupled_weight_decay: bool,
    corrections: dict[tuple[int, float, float], tuple[float, float]] | None = None,
) -> None:
    """Write one step's scalars (:data:`STEP_SCALAR_FIELDS`) into a param row, as
    :func:`prepare_table` does: bitsandbytes' CPU fallback, each computed in float64 and
    rounded to float32 in the row; 8-bit state ``step_size = -lr / (1 - beta1**step)``,
    ``bc2_sqrt = sqrt(1 - beta2**step)``; float32 state ``step_size = -lr * bc2_sqrt /
    (1 - beta1**step)`` and ``eps * bc2_sqrt``; ``decay = 1 - lr * weight_decay``.

    Args:
        row: the param row (of a :class:`Table`, or of :func:`step_rows`).
        step: the step this update makes (``>= 1``; not checked here).
        lr, betas, eps, weight_decay, coupled_weight_decay: as in :class:`Job`.
        quantized: whether the param's state is 8-bit codes (else float32).
        corrections: ``(step, beta1, beta2) -> (1 - beta1**step, sqrt(1 - beta2**step))``
            computed so far, read and filled here (one computation per distinct key).
    """
    beta1, beta2 = float(betas[0]), float(betas[1])
    # Python floats: a numpy float32 option (which validation takes) would make
    # ``eps * bc2_sqrt`` a float32 product, rounded twice
    lr, wd, eps = float(lr), float(weight_decay), float(eps)
    key = (step, beta1, beta2)
    found = None if corrections is None else corrections.get(key)
    if found is None:
        found = (1.0 - beta1**step, math.sqrt(1.0 - beta2**step))
        if corrections is not None:
            corrections[key] = found
    bc1, bc2_sqrt = found
    row.beta1 = beta1
    row.one_minus_beta1 = 1.0 - beta1
    row.beta2 = beta2
    row.one_minus_beta2 = 1.0 - beta2
    row.bc2_sqrt = bc2_sqrt
    if quantized:
        row.eps = eps
        row.step_size = -lr / bc1
    else:
        row.eps = eps * bc2_sqrt
        row.step_size = -lr * bc2_sqrt / bc1
    has_wd = wd > 0.0
    row.coupled = int(has_wd and coupled_weight_decay)
    row.decoupled = int(has_wd and not coupled_weight_decay)
    row.decay = 1.0 - lr * wd if row.decoupled else 1.0
    row.weight_decay = wd if row.coupled else 0.0


def prepare_table(jobs: Sequence[Job], *, num_threads: int | None = None) -> Table:
    """Check the jobs and write the tables of one step (the prepare phase).

    The per-step scalars follow bitsandbytes' CPU fallback, each computed in float64 and
    rounded to float32 in the table: 8-bit state ``step_size = -lr / (1 - beta1**step)``,
    ``bc2_sqrt = sqrt(1 - beta2**step)``; float32 state ``step_size = -lr * bc2_sqrt /
    (1 - beta1**step)`` and ``eps * bc2_sqrt``; ``decay = 1 - lr * weight_decay``.

    Args:
        jobs: the params to step, any mix of dtypes and state formats.
        num_threads: worker threads; default ``torch.get_num_threads()``, fewer for
            small steps (at least 65,536 elements per thread).

    Returns:
        The :class:`Table` for :func:`run_table`.

    Raises:
        ValueError: naming the job and field whose tensor has the wrong dtype, shape,
            device or layout, or a step below 1.
    """
    params = (_Param * len(jobs))()
    n_items = sum(
        _ceil_div(_ceil_div(job.param.numel(), BLOCK_SIZE), _BLOCKS_PER_ITEM) for job in jobs
    )
    items = (_Item * max(n_items, 1))()
    keep: list[torch.Tensor | None] = []
    corrections: dict[tuple[int, float, float], tuple[float, float]] = {}
    item = 0
    total = 0
    for k, job in enumerate(jobs):
        if reason := param_unsupported_reason(job.param, job.grad):
            raise ValueError(f"jobs[{k}]: {reason}")
        if isinstance(job.step, bool) or not isinstance(job.step, int) or job.step < 1:
            raise ValueError(f"jobs[{k}].step must be an int >= 1, got {job.step!r}")
        quantized = _check_state(k, job)
        row = params[k]
        write_step_scalars(
            row,
            step=job.step,
            lr=job.lr,
            betas=job.betas,
            eps=job.eps,
            weight_decay=job.weight_decay,
            quantized=quantized,
            coupled_weight_decay=job.coupled_weight_decay,
            corrections=corrections,
        )
        row.param = job.param.data_ptr()
        row.grad = job.grad.data_ptr()
        row.state1 = job.state1.data_ptr()
        row.state2 = job.state2.data_ptr()
        row.numel = job.param.numel()
        row.param_dtype = PARAM_DTYPE_CODES[job.param.dtype]
        row.grad_dtype = PARAM_DTYPE_CODES[job.grad.dtype]
        row.quantized = int(quantized)
        if quantized:
            for name in (
                "absmax1",
                "absmax2",
                "qmap1",
                "qmap2",
                "bounds1",
                "bounds2",
                "table1",
                "table2",
            ):
                setattr(row, name, getattr(job, name).data_ptr())
        blocks = _ceil_div(row.numel, BLOCK_SIZE)
        for first in range(0, blocks, _BLOCKS_PER_ITEM):
            it = items[item]
            it.param = k
            it.first_block = first
            it.n_blocks = min(_BLOCKS_PER_ITEM, blocks - first)
            item += 1
        total += row.numel
        keep += [job.param, job.grad, job.state1, job.state2, job.absmax1, job.absmax2]
        keep += [job.qmap1, job.qmap2, job.bounds1, job.bounds2, job.table1, job.table2]
    threads = torch.get_num_threads() if num_threads is None else num_threads
    threads = max(1, min(threads, total // _MIN_ELEMENTS_PER_THREAD))
    return Table(params=params, items=items, n_items=item, threads=threads, tensors=tuple(keep))


def run_table(table: Table, library: ctypes.CDLL | None = None, *, simd: bool | int = True) -> None:
    """Run one step on prepared tables (the commit phase): params, codes, absmax and
    float32 state are written in place; nothing is allocated.

    Args:
        table: from :func:`prepare_table`, for tensors not changed since.
        library: from :func:`load_library`; default :func:`load_library` (cached).
        simd: False keeps to the scalar loops; by default whole blocks of 8-bit state run
            on AVX-512 or AVX2 lanes where the CPU has them (the same bits: the same IEEE
            operations in the same order; tested). A level such as :data:`SIMD_AVX2` caps
            the path (on an AVX-512 CPU, the AVX2 path: for tests and benchmarks).

    Raises:
        KernelBuildError: if the kernel cannot be built or loaded.
    """
    if table.n_items == 0:
        return
    lib = load_library() if library is None else library
    lib.ol_adamw8bit_step(table.params, table.items, table.n_items, table.threads, _simd_arg(simd))
