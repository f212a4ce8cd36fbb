"""The Triton kernel of optladder's AdamW: one launch updates every param of a group.

Params of float32, bfloat16 or float16 (one dtype per launch) with grads of any of those,
moments in bfloat16 (the bf16 rung) or float32 (the fp32 rung for low-precision params),
all math in float32, in the eager oracle's operation order: the kernel writes the bits of
:func:`optladder.optimizers.eager.eager_step`.

Importing this module imports Triton; :mod:`optladder` imports it only when a step needs
it (see :mod:`optladder.optimizers.kernels.ops`). Under ``TRITON_INTERPRET=1`` (set before
this module is first imported) the same kernel runs on CPU tensors through Triton's
interpreter, which is how the tests check it without a GPU.

Multi-tensor layout: a device table with one int64 row per param (``_META_COLS`` columns:
data pointers of param, grad, ``exp_avg``, ``exp_avg_sq`` and ``step``, element count,
param index) and a chunk table with one ``(row, first element)`` pair per program. Both
depend only on the pointers and sizes, so they are built once on the host and cached; a
CUDA graph captured after one warm-up step replays with no host work.

bfloat16 moments and low-precision params are read and written as their uint16 bit
patterns (the rounding is integer arithmetic on the float32 pattern), so the kernel
writes exactly the bits of :mod:`optladder.optimizers.rounding`, compiled or interpreted.
Bias corrections are computed per program in float64 from the param's step count, by the
binary powering of :func:`optladder.optimizers.eager.step_scalars` (so per-param step
counts cost nothing and the scalars are the host's bits); ``lr`` and the betas arrive as
float64 bit patterns.
"""

# mypy: disable-error-code="no-untyped-def"
from __future__ import annotations

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
LAUNCH_OPTIONS: dict[str, object] = {"num_warps": 4, "enable_fp_fusion": False}
"""Compile options of every launch. ``enable_fp_fusion=False``: only the ``tl.fma`` calls
written here fuse; by default the compiler contracts a multiply and an add into one fma
(one rounding), so the decoupled decay ``p * decay`` and the update's sum, and the
float64 ``1 - lr * wd``, became fmas on CUDA and the params lost the eager oracle's bits
(the C kernel is built with ``-ffp-contract=off`` for the same reason; the interpreter
never fuses)."""
_META_COLS = 8
_CACHE_SIZE = 64
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_PARAM_STREAM = tl.constexpr(0x1B873593)  # optladder.optimizers.rounding.PARAM_STREAM; a
# constexpr: the compiler refuses other globals in a kernel (the interpreter does not)

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
def _load(ptr, mask, MASKED: tl.constexpr):
    """``tl.load`` that reads zero where ``mask`` is false; ``MASKED=False``: no mask
    (``mask`` is None then). A constexpr flag, not ``mask is None``: compiled, a None
    argument arrives as ``constexpr(None)``, which ``is None`` does not match, and
    ``other`` without a mask is an error (the interpreter runs plain Python and matched)."""
    if MASKED:
        return tl.load(ptr, mask=mask, other=0)
    return tl.load(ptr)


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
def _round_f16_sr(x, r):
    """float32 -> float16 bit pattern (uint16), stochastic with 32 random bits ``r``
    (:func:`optladder.optimizers.rounding.stochastic_round_f16`)."""
    u = x.to(tl.uint32, bitcast=True)
    a = u & _u32(0x7FFFFFFF)
    s = u & _u32(0x80000000)
    e = (a >> 23).to(tl.int32)
    sh = tl.minimum(tl.maximum(126 - e, 13), 23).to(tl.uint32)
    mask = (_u32(1) << sh) - _u32(1)
    big = (a + (r & mask)) & (mask ^ _u32(0xFFFFFFFF))
    t = a.to(tl.float32, bitcast=True) * 281474976710656.0  # |x| * 2**48, exact
    tiny = tl.where((r >> 8).to(tl.float32) < t, _u32(0x33800000), _u32(0))
    y = s | tl.where(e >= 103, big, tiny)
    h = y.to(tl.float32, bitcast=True).to(tl.float16).to(tl.uint16, bitcast=True)
    nan = ((s >> 16) | _u32(0x7E00)).to(tl.uint16)
    return tl.where(a > _u32(0x7F800000), nan, h)


@triton.jit
def _update(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    offs,
    mask,
    key,
    pkey,
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
    PARAM_KIND: tl.constexpr,
    MOMENT_F32: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    DECOUPLED: tl.constexpr,
    COUPLED: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    PARAM_SR: tl.constexpr,
    LERP_SMALL: tl.constexpr,
    MASKED: tl.constexpr,
):
    if GRAD_KIND == 0:
        g = _load(g_ptr.to(tl.pointer_type(tl.float32)) + offs, mask, MASKED)
    elif GRAD_KIND == 1:
        gb = _load(g_ptr.to(tl.pointer_type(tl.uint16)) + offs, mask, MASKED)
        g = (gb.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        g = _load(g_ptr.to(tl.pointer_type(tl.float16)) + offs, mask, MASKED)
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
    if PARAM_KIND == 0:
        pp = p_ptr.to(tl.pointer_type(tl.float32)) + offs
        p = _load(pp, mask, MASKED)
    elif PARAM_KIND == 1:
        pp = p_ptr.to(tl.pointer_type(tl.uint16)) + offs
        p = (_load(pp, mask, MASKED).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        pp = p_ptr.to(tl.pointer_type(tl.float16)) + offs
        p = _load(pp, mask, MASKED).to(tl.float32)
    if DECOUPLED:
        p = p * decay
    if COUPLED:
        g = tl.fma(p, wd, g)
    if MOMENT_F32:
        mp = m_ptr.to(tl.pointer_type(tl.float32)) + offs
        vp = v_ptr.to(tl.pointer_type(tl.float32)) + offs
        m = _load(mp, mask, MASKED)
        v = _load(vp, mask, MASKED)
    else:
        mp = m_ptr.to(tl.pointer_type(tl.uint16)) + offs
        vp = v_ptr.to(tl.pointer_type(tl.uint16)) + offs
        m = (_load(mp, mask, MASKED).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        v = (_load(vp, mask, MASKED).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    # torch's lerp: self + w * (end - self) for w < 0.5, else end - (end - self) * (1 - w)
    m = tl.fma(lerp_w, g - m, m) if LERP_SMALL else tl.fma(lerp_w - 1.0, g - m, g)
    v = tl.fma(omb2 * g, g, v * beta2)  # torch's addcmul: fmadd(value * t1, t2, self)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p + tl.div_rn(step_size * m, denom)
    if PARAM_KIND == 0:
        tl.store(pp, p, mask=mask)
    elif PARAM_KIND == 1:
        if PARAM_SR:
            pbits = _hash32(offs.to(tl.uint32) + pkey)
            tl.store(pp, _round_bf16(p, pbits & _u32(0xFFFF), True), mask=mask)
        else:
            tl.store(pp, _round_bf16(p, _u32(0), False), mask=mask)
    else:
        if PARAM_SR:
            pbits = _hash32(offs.to(tl.uint32) + pkey)
            tl.store(pp.to(tl.pointer_type(tl.uint16)), _round_f16_sr(p, pbits), mask=mask)
        else:
            tl.store(pp, p.to(tl.float16), mask=mask)
    if MOMENT_F32:
        tl.store(mp, m, mask=mask)
        tl.store(vp, v, mask=mask)
    elif STOCHASTIC:
        bits = _hash32(offs.to(tl.uint32) + key)
        tl.store(mp, _round_bf16(m, bits & _u32(0xFFFF), True), mask=mask)
        tl.store(vp, _round_bf16(v, bits >> 16, True), mask=mask)
    else:
        tl.store(mp, _round_bf16(m, _u32(0), False), mask=mask)
        tl.store(vp, _round_bf16(v, _u32(0), False), mask=mask)


@triton.jit
def _pow_f64(base, n):
    """``base ** n`` for float64 ``base`` and an integer ``0 <= n < 2**32``: the binary
    powering of :func:`optladder.optimizers.eager.power`, multiplication for
    multiplication."""
    r = tl.full((), 1.0, tl.float64)
    b = base
    for k in tl.static_range(32):
        r = tl.where(((n >> k) & 1) != 0, r * b, r)
        b = b * b
    return r


@triton.jit(do_not_specialize=["seed_key", "lr_bits", "beta1_bits", "beta2_bits", "wd_bits"])
def _adamw_bf16_kernel(
    meta_ptr,
    chunks_ptr,
    lr_ptr,
    scale_ptr,
    found_inf_ptr,
    lr_bits,
    beta1_bits,
    beta2_bits,
    wd_bits,
    lerp_w,
    beta2,
    omb2,
    eps,
    wd,
    seed_key,
    GRAD_KIND: tl.constexpr,
    PARAM_KIND: tl.constexpr,
    MOMENT_F32: tl.constexpr,
    LR_TENSOR: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_INF: tl.constexpr,
    DECOUPLED: tl.constexpr,
    COUPLED: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    PARAM_SR: tl.constexpr,
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
            lr = tl.cast(lr_bits, tl.int64).to(tl.float64, bitcast=True)
        b1 = tl.cast(beta1_bits, tl.int64).to(tl.float64, bitcast=True)
        b2 = tl.cast(beta2_bits, tl.int64).to(tl.float64, bitcast=True)
        bc1 = 1.0 - _pow_f64(b1, n)
        bc2 = 1.0 - _pow_f64(b2, n)
        step_size = (-lr / bc1).to(tl.float32)  # float64 division is IEEE
        bc2_sqrt = tl.sqrt(bc2).to(tl.float32)  # float64 sqrt is IEEE
        wd64 = tl.cast(wd_bits, tl.int64).to(tl.float64, bitcast=True)
        decay = (1.0 - lr * wd64).to(tl.float32)
        scale = 1.0
        if HAS_SCALE:
            scale = tl.load(scale_ptr).to(tl.float32)
        key = _mix(tl.cast(seed_key, tl.uint32), n.to(tl.uint32))
        key = _mix(key, pidx.to(tl.uint32))
        key = _mix(key, (pidx >> 32).to(tl.uint32))
        pkey = _mix(key, _u32(_PARAM_STREAM))
        p_ptr = p_int.to(tl.pointer_type(tl.uint8))
        g_ptr = g_int.to(tl.pointer_type(tl.uint8))
        m_ptr = m_int.to(tl.pointer_type(tl.uint8))
        v_ptr = v_int.to(tl.pointer_type(tl.uint8))
        if start + CHUNK_SIZE <= numel:  # a whole chunk: no masks, vector loads
            for i in tl.static_range(CHUNK_SIZE // BLOCK_SIZE):
                offs = start + i * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
                _update(
                    p_ptr, g_ptr, m_ptr, v_ptr, offs, None, key, pkey, scale, step_size,
                    bc2_sqrt, decay, lerp_w, beta2, omb2, eps, wd, GRAD_KIND, PARAM_KIND,
                    MOMENT_F32, HAS_SCALE, DECOUPLED, COUPLED, MAXIMIZE, STOCHASTIC, PARAM_SR,
                    LERP_SMALL, False,
                )  # fmt: skip
        else:
            for i in tl.static_range(CHUNK_SIZE // BLOCK_SIZE):
                offs = start + i * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
                _update(
                    p_ptr, g_ptr, m_ptr, v_ptr, offs, offs < numel, key, pkey, scale,
                    step_size, bc2_sqrt, decay, lerp_w, beta2, omb2, eps, wd, GRAD_KIND,
                    PARAM_KIND, MOMENT_F32, HAS_SCALE, DECOUPLED, COUPLED, MAXIMIZE,
                    STOCHASTIC, PARAM_SR, LERP_SMALL, True,
                )  # fmt: skip


def _bits64(x: float) -> int:
    """The bit pattern of a float64 as a signed int64 (Triton passes Python floats as
    float32; the kernel bitcasts this back to the exact float64)."""
    return int(struct.unpack("<q", struct.pack("<d", float(x)))[0])


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def prepare_tables(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    param_indices: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The device tables of one launch over these tensors (int64 rows of pointers, numels
    and param indices; int64 ``(row, start)`` chunk pairs; the chunk count), built once
    and cached by the tensors' addresses, so that a launch after an optimizer's prepare
    phase (which calls this) allocates nothing."""
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
    param_stochastic: bool,
    seed_key: int,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
) -> None:
    """Launch the kernel once for all params (steps must already count this step).

    Args: as :func:`optladder.optimizers.kernels.ops.adamw_bf16_`.
    """
    if not params:
        return
    meta, chunks, n_chunks = prepare_tables(
        params, grads, exp_avgs, exp_avg_sqs, steps, param_indices
    )
    if n_chunks == 0:  # only empty params: their step counts still advance
        return
    aligned = all(
        t.data_ptr() % 16 == 0 for ts in (params, grads, exp_avgs, exp_avg_sqs) for t in ts
    )
    has_wd = weight_decay != 0.0
    dummy = meta  # any pointer for absent optional tensors; never read
    _adamw_bf16_kernel[(n_chunks,)](
        meta,
        chunks,
        lr_tensor if lr_tensor is not None else dummy,
        grad_scale if grad_scale is not None else dummy,
        found_inf if found_inf is not None else dummy,
        _bits64(lr),
        _bits64(beta1),
        _bits64(beta2),
        _bits64(weight_decay),
        _f32(1.0 - beta1),
        _f32(beta2),
        _f32(1.0 - beta2),
        _f32(eps),
        _f32(weight_decay),
        seed_key,
        GRAD_KIND=_KINDS[grads[0].dtype],
        PARAM_KIND=_KINDS[params[0].dtype],
        MOMENT_F32=exp_avgs[0].dtype == torch.float32,
        LR_TENSOR=lr_tensor is not None,
        HAS_SCALE=grad_scale is not None,
        HAS_INF=found_inf is not None,
        DECOUPLED=has_wd and decoupled_weight_decay,
        COUPLED=has_wd and not decoupled_weight_decay,
        MAXIMIZE=maximize,
        STOCHASTIC=stochastic,
        PARAM_SR=param_stochastic,
        LERP_SMALL=(1.0 - beta1) < 0.5,
        ALIGNED=aligned,
        CHUNK_SIZE=CHUNK,
        BLOCK_SIZE=BLOCK,
        **LAUNCH_OPTIONS,
    )
