"""The Triton kernel of the bf16 rung: one launch updates every param of a group.

Importing this module imports Triton; :mod:`optladder` imports it only when a step needs
it (see :mod:`optladder.optimizers.kernels.ops`). Under ``TRITON_INTERPRET=1`` (set before
this module is first imported) the same kernel runs on CPU tensors through Triton's
interpreter, which is how the tests check it without a GPU.

Multi-tensor layout: a device table with one int64 row per param (``_META_COLS`` columns:
data pointers of param, grad, ``exp_avg``, ``exp_avg_sq`` and ``step``, element count,
param index) and a chunk table with one ``(row, first element)`` pair per program. Both
depend only on the pointers and sizes, so they are built once on the host and cached; a
CUDA graph captured after one warm-up step replays with no host work.

Moments are read and written as their uint16 bit patterns (the rounding is integer
arithmetic on the float32 pattern), so the kernel writes exactly the bits of
:func:`optladder.optimizers.rounding.stochastic_round_bf16`, compiled or interpreted.
Bias corrections are computed per program in float64 from the param's step count
(``beta**step`` by binary powering), so per-param step counts cost nothing.
"""

# mypy: disable-error-code="no-untyped-def"
from __future__ import annotations

import math
import struct
from collections import OrderedDict
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

BLOCK = 1024
"""Elements per vector operation of one program."""
CHUNK = 4 * BLOCK
"""Elements per program (one row of the chunk table)."""
_META_COLS = 8
_CACHE_SIZE = 64
_GRAD_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

# Device tables keyed by pointers and sizes; a cache (its content is a pure function of
# the key), bounded, least recently used first out.
_tables: OrderedDict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor, int]] = OrderedDict()


@triton.jit
def _u32(x: tl.constexpr):
    return tl.full((), x, tl.uint32)


@triton.jit
def _hash32(x):
    """lowbias32 on uint32 values (wrapping multiplies)."""
    x = x ^ (x >> 16)
    x = x * _u32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * _u32(0x846CA68B)
    x = x ^ (x >> 16)
    return x


@triton.jit
def _mix(a, b):
    return _hash32((a * _u32(0x9E3779B9)) ^ b)


@triton.jit
def _load(ptr, mask):
    """``tl.load`` that reads zero where ``mask`` is false; ``mask=None``: no mask."""
    if mask is None:
        return tl.load(ptr)
    return tl.load(ptr, mask=mask, other=0)


@triton.jit
def _round_bf16(x, r16, STOCHASTIC: tl.constexpr):
    """float32 -> bfloat16 bit pattern (uint16): stochastic with ``r16``, or nearest."""
    u = x.to(tl.uint32, bitcast=True)
    is_nan = (u & _u32(0x7FFFFFFF)) > _u32(0x7F800000)
    if STOCHASTIC:
        r = (u + r16) & _u32(0xFFFF0000)
        r = tl.where(is_nan, (u & _u32(0xFFFF0000)) | _u32(0x00400000), r)
    else:
        r = (u + _u32(0x7FFF) + ((u >> 16) & _u32(1))) & _u32(0xFFFF0000)
        r = tl.where(is_nan, _u32(0x7FC00000), r)
    return (r >> 16).to(tl.uint16)


@triton.jit
def _update(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    offs,
    mask,
    key,
    scale,
    step_size,
    bc2_sqrt,
    decay,
    lerp_w,
    beta2,
    omb2,
    eps,
    wd,
    GRAD_KIND: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    DECOUPLED: tl.constexpr,
    COUPLED: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    LERP_SMALL: tl.constexpr,
):
    if GRAD_KIND == 0:
        g = _load(g_ptr.to(tl.pointer_type(tl.float32)) + offs, mask)
    elif GRAD_KIND == 1:
        gb = _load(g_ptr.to(tl.pointer_type(tl.uint16)) + offs, mask)
        g = (gb.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        g = _load(g_ptr.to(tl.pointer_type(tl.float16)) + offs, mask)
        g = g.to(tl.float32)
    if HAS_SCALE:
        g = tl.div_rn(g, scale)
        # Like torch's fused Adam, leave the unscaled grad in the grad tensor.
        if GRAD_KIND == 0:
            tl.store(g_ptr.to(tl.pointer_type(tl.float32)) + offs, g, mask=mask)
        elif GRAD_KIND == 1:
            gs = _round_bf16(g, _u32(0), False)
            tl.store(g_ptr.to(tl.pointer_type(tl.uint16)) + offs, gs, mask=mask)
        else:
            tl.store(g_ptr.to(tl.pointer_type(tl.float16)) + offs, g.to(tl.float16), mask=mask)
    if MAXIMIZE:
        g = -g
    pp = p_ptr.to(tl.pointer_type(tl.float32)) + offs
    p = _load(pp, mask)
    if DECOUPLED:
        p = p * decay
    if COUPLED:
        g = tl.fma(p, wd, g)
    mp = m_ptr.to(tl.pointer_type(tl.uint16)) + offs
    vp = v_ptr.to(tl.pointer_type(tl.uint16)) + offs
    m = (_load(mp, mask).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    v = (_load(vp, mask).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    # torch's lerp: self + w * (end - self) for w < 0.5, else end - (end - self) * (1 - w)
    m = tl.fma(lerp_w, g - m, m) if LERP_SMALL else tl.fma(lerp_w - 1.0, g - m, g)
    v = tl.fma(omb2 * g, g, v * beta2)  # torch's addcmul: fmadd(value * t1, t2, self)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p + tl.div_rn(step_size * m, denom)
    tl.store(pp, p, mask=mask)
    if STOCHASTIC:
        bits = _hash32(offs.to(tl.uint32) + key)
        tl.store(mp, _round_bf16(m, bits & _u32(0xFFFF), True), mask=mask)
        tl.store(vp, _round_bf16(v, bits >> 16, True), mask=mask)
    else:
        tl.store(mp, _round_bf16(m, _u32(0), False), mask=mask)
        tl.store(vp, _round_bf16(v, _u32(0), False), mask=mask)


@triton.jit
def _pow_f64(base, n):
    """``base ** n`` for float64 ``base`` and an integer ``0 <= n < 2**32``."""
    r = tl.full((), 1.0, tl.float64)
    b = base
    for k in tl.static_range(32):
        r = tl.where(((n >> k) & 1) != 0, r * b, r)
        b = b * b
    return r


@triton.jit(do_not_specialize=["seed_key"])
def _adamw_bf16_kernel(
    meta_ptr,
    chunks_ptr,
    lr_ptr,
    scale_ptr,
    found_inf_ptr,
    lr_hi,
    lr_lo,
    beta1_hi,
    beta1_lo,
    beta2_hi,
    beta2_lo,
    lerp_w,
    beta2,
    omb2,
    eps,
    wd,
    seed_key,
    GRAD_KIND: tl.constexpr,
    LR_TENSOR: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_INF: tl.constexpr,
    DECOUPLED: tl.constexpr,
    COUPLED: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    LERP_SMALL: tl.constexpr,
    ALIGNED: tl.constexpr,
    CHUNK_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    row = tl.load(chunks_ptr + 2 * pid)
    start = tl.load(chunks_ptr + 2 * pid + 1)
    meta = meta_ptr + row * 8  # _META_COLS int64 columns per param
    p_int = tl.load(meta)
    g_int = tl.load(meta + 1)
    m_int = tl.load(meta + 2)
    v_int = tl.load(meta + 3)
    s_int = tl.load(meta + 4)
    numel = tl.load(meta + 5)
    pidx = tl.load(meta + 6)
    if ALIGNED:  # every pointer is 16-byte aligned: lets the compiler vectorize
        p_int = tl.multiple_of(p_int, 16)
        g_int = tl.multiple_of(g_int, 16)
        m_int = tl.multiple_of(m_int, 16)
        v_int = tl.multiple_of(v_int, 16)
        start = tl.multiple_of(start, CHUNK_SIZE)
    go = True
    if HAS_INF:
        go = tl.load(found_inf_ptr) == 0.0
    if go:
        step = tl.load(s_int.to(tl.pointer_type(tl.float64)))  # already incremented
        n = step.to(tl.int64)
        if LR_TENSOR:
            lr = tl.load(lr_ptr).to(tl.float64)
        else:
            lr = tl.cast(lr_hi, tl.float64) + tl.cast(lr_lo, tl.float64)
        b1 = tl.cast(beta1_hi, tl.float64) + tl.cast(beta1_lo, tl.float64)
        b2 = tl.cast(beta2_hi, tl.float64) + tl.cast(beta2_lo, tl.float64)
        bc1 = 1.0 - _pow_f64(b1, n)
        bc2 = 1.0 - _pow_f64(b2, n)
        step_size = (-lr / bc1).to(tl.float32)  # float64 division is IEEE
        bc2_sqrt = tl.sqrt(bc2).to(tl.float32)  # float64 sqrt is IEEE
        decay = (1.0 - lr * tl.cast(wd, tl.float64)).to(tl.float32)
        scale = 1.0
        if HAS_SCALE:
            scale = tl.load(scale_ptr).to(tl.float32)
        key = _mix(tl.cast(seed_key, tl.uint32), n.to(tl.uint32))
        key = _mix(key, pidx.to(tl.uint32))
        key = _mix(key, (pidx >> 32).to(tl.uint32))
        p_ptr = p_int.to(tl.pointer_type(tl.float32))
        g_ptr = g_int.to(tl.pointer_type(tl.uint8))
        m_ptr = m_int.to(tl.pointer_type(tl.uint16))
        v_ptr = v_int.to(tl.pointer_type(tl.uint16))
        if start + CHUNK_SIZE <= numel:  # a whole chunk: no masks, vector loads
            for i in tl.static_range(CHUNK_SIZE // BLOCK_SIZE):
                offs = start + i * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
                _update(
                    p_ptr, g_ptr, m_ptr, v_ptr, offs, None, key, scale, step_size, bc2_sqrt,
                    decay, lerp_w, beta2, omb2, eps, wd, GRAD_KIND, HAS_SCALE, DECOUPLED,
                    COUPLED, MAXIMIZE, STOCHASTIC, LERP_SMALL,
                )  # fmt: skip
        else:
            for i in tl.static_range(CHUNK_SIZE // BLOCK_SIZE):
                offs = start + i * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
                _update(
                    p_ptr, g_ptr, m_ptr, v_ptr, offs, offs < numel, key, scale, step_size,
                    bc2_sqrt, decay, lerp_w, beta2, omb2, eps, wd, GRAD_KIND, HAS_SCALE,
                    DECOUPLED, COUPLED, MAXIMIZE, STOCHASTIC, LERP_SMALL,
                )  # fmt: skip


def _split(x: float) -> tuple[float, float]:
    """A float64 as the sum of two float32 values (Triton passes Python floats as fp32)."""
    hi = _f32(x)
    return hi, _f32(x - hi)


def _f32(x: float) -> float:
    """``x`` rounded to float32 (to nearest even, as a cast does), without a tensor: the
    commit allocates nothing."""
    try:
        return float(struct.unpack("f", struct.pack("f", x))[0])
    except OverflowError:  # beyond float32's range: a cast gives an infinity
        return math.copysign(math.inf, x)


def prepare_tables(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    param_indices: Sequence[int],
) -> None:
    """Build (or find cached) the device tables :func:`launch` reads for these tensors, in
    the prepare phase of a step, so that the launch in the commit allocates nothing."""
    if params:
        _tables_for(params, grads, exp_avgs, exp_avg_sqs, steps, param_indices)


def _tables_for(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    param_indices: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor, int]:
    device = params[0].device
    rows = [
        (p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), s.data_ptr(), p.numel(), i, 0)
        for p, g, m, v, s, i in zip(
            params, grads, exp_avgs, exp_avg_sqs, steps, param_indices, strict=True
        )
    ]
    key = (device, tuple(rows))
    hit = _tables.get(key)
    if hit is not None:
        _tables.move_to_end(key)
        return hit
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "the bf16 Triton kernel met new tensors while a CUDA graph is being captured; "
            "run one optimizer step before capturing (warm-up) so its tables exist"
        )
    chunks = [(r, s) for r, row in enumerate(rows) for s in range(0, row[5], CHUNK)]
    meta_t = torch.tensor(rows, dtype=torch.int64).to(device)
    chunks_t = torch.tensor(chunks, dtype=torch.int64).reshape(-1, 2).to(device)
    entry = (meta_t, chunks_t, len(chunks))
    _tables[key] = entry
    if len(_tables) > _CACHE_SIZE:
        _tables.popitem(last=False)
    return entry


def launch(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    param_indices: Sequence[int],
    *,
    lr: float,
    lr_tensor: torch.Tensor | None,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
    stochastic: bool,
    seed_key: int,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
) -> None:
    """Launch the kernel once for all params (steps must already count this step).

    Args: as :func:`optladder.optimizers.kernels.ops.adamw_bf16_`.
    """
    if not params:
        return
    meta, chunks, n_chunks = _tables_for(params, grads, exp_avgs, exp_avg_sqs, steps, param_indices)
    if n_chunks == 0:  # only empty params: their step counts still advance
        return
    aligned = all(
        t.data_ptr() % 16 == 0 for ts in (params, grads, exp_avgs, exp_avg_sqs) for t in ts
    )
    has_wd = weight_decay != 0.0
    lr_hi, lr_lo = _split(lr)
    b1_hi, b1_lo = _split(beta1)
    b2_hi, b2_lo = _split(beta2)
    dummy = meta  # any pointer for absent optional tensors; never read
    _adamw_bf16_kernel[(n_chunks,)](
        meta,
        chunks,
        lr_tensor if lr_tensor is not None else dummy,
        grad_scale if grad_scale is not None else dummy,
        found_inf if found_inf is not None else dummy,
        lr_hi,
        lr_lo,
        b1_hi,
        b1_lo,
        b2_hi,
        b2_lo,
        _f32(1.0 - beta1),
        _f32(beta2),
        _f32(1.0 - beta2),
        _f32(eps),
        _f32(weight_decay),
        seed_key,
        GRAD_KIND=_GRAD_KINDS[grads[0].dtype],
        LR_TENSOR=lr_tensor is not None,
        HAS_SCALE=grad_scale is not None,
        HAS_INF=found_inf is not None,
        DECOUPLED=has_wd and decoupled_weight_decay,
        COUPLED=has_wd and not decoupled_weight_decay,
        MAXIMIZE=maximize,
        STOCHASTIC=stochastic,
        LERP_SMALL=(1.0 - beta1) < 0.5,
        ALIGNED=aligned,
        CHUNK_SIZE=CHUNK,
        BLOCK_SIZE=BLOCK,
        num_warps=4,
    )
