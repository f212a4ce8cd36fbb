"""The eager AdamW step of :class:`LadderAdamW`, allocating nothing while it writes.

This is the oracle every kernel matches bit for bit: torch operations in a fixed order
(``lerp_``, ``mul_``/``addcmul_``, the square root, ``div_``/``add_``, ``addcdiv_``), then
the integer hash and rounding of :mod:`optladder.optimizers.rounding` for bfloat16
moments and low-precision param writes. All math is in float32 whatever the storage
dtypes; the square root is taken in float64 and rounded to float32, which is the IEEE
float32 square root (a float64 root of a float32 rounds correctly to float32: 53 >= 2*24+2,
Figueroa, "When is double rounding innocuous?", 1995). torch's own float32 ``sqrt`` on the
CPU goes through MKL's vector math and is not correctly rounded in ~15% of elements, so
it would tie the bits to the machine.

It runs on scratch buffers allocated beforehand (:class:`EagerScratch`), so the commit
phase of a two-phase step cannot run out of memory. Contiguous params are processed in
chunks of at most :data:`CHUNK` elements, which bounds the scratch; every operation is
elementwise and the random bits are indexed by the global element index, so chunking
changes no bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from optladder.optimizers.rounding import _M1, _M2, MASK32, element_key, param_key

CHUNK = 1 << 18
"""Elements per chunk of a contiguous param (262,144: 82 bytes each of scratch, 21.5 MB)."""

LOW_PRECISION_PARAMS = (torch.bfloat16, torch.float16)
"""Param dtypes whose writes are rounded (``param_rounding``)."""


@dataclass
class EagerScratch:
    """Preallocated buffers for :func:`eager_step`, each of ``length`` elements.

    float32: param, grad, exp_avg, exp_avg_sq, denom; float64: root; int64: 4; int32: 2;
    bool: 1. 82 bytes per element.
    """

    length: int
    device: torch.device
    f32: tuple[torch.Tensor, ...]
    f64: torch.Tensor
    i64: tuple[torch.Tensor, ...]
    i32: tuple[torch.Tensor, torch.Tensor]
    mask: torch.Tensor

    @classmethod
    def allocate(cls, length: int, device: torch.device) -> EagerScratch:
        """Allocate the buffers (this is where an OOM can happen)."""

        def make(dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(length, dtype=dtype, device=device)

        return cls(
            length,
            device,
            tuple(make(torch.float32) for _ in range(5)),
            make(torch.float64),
            tuple(make(torch.int64) for _ in range(4)),
            (make(torch.int32), make(torch.int32)),
            make(torch.bool),
        )


def power(base: float, n: int) -> float:
    """``base ** n`` by binary powering over the 32 bits of ``0 <= n < 2**32``.

    Every backend computes the bias corrections with exactly these float64
    multiplications (the Triton kernel on the device), so their bits agree everywhere;
    Python's ``**`` calls the C library's ``pow``, whose last bit differs between
    libraries.
    """
    r, b = 1.0, base
    for k in range(32):
        if (n >> k) & 1:
            r = r * b
        b = b * b
    return r


def bias_corrections(beta1: float, beta2: float, step: int) -> tuple[float, float]:
    """``(1 - beta1**step, sqrt(1 - beta2**step))`` of a 1-based ``step``, in float64,
    with :func:`power` (Kingma & Ba, "Adam", ICLR 2015, Algorithm 1)."""
    return 1.0 - power(beta1, step), math.sqrt(1.0 - power(beta2, step))


def step_scalars(lr: float, beta1: float, beta2: float, step: int) -> tuple[float, float]:
    """``(step_size, bias_correction2_sqrt)`` of a 1-based ``step``, in float64.

    ``step_size = -lr / (1 - beta1**step)`` and ``sqrt(1 - beta2**step)``, from
    :func:`bias_corrections` (folded into the step size and the denominator as torch's
    ``_single_tensor_adam`` does).
    """
    bc1, bc2_sqrt = bias_corrections(beta1, beta2, step)
    return -lr / bc1, bc2_sqrt


def scratch_length(p: torch.Tensor) -> int:
    """Scratch elements :func:`eager_step` needs for ``p``: a chunk, or the whole param
    when it (or its grad) is not contiguous."""
    grad = p.grad
    contiguous = p.is_contiguous() and grad is not None and grad.is_contiguous()
    return min(p.numel(), CHUNK) if contiguous else p.numel()


def _hash32_(x: torch.Tensor, tmp: torch.Tensor) -> None:
    """In-place :func:`optladder.optimizers.rounding.hash32_tensor`."""
    torch.bitwise_right_shift(x, 16, out=tmp)
    x.bitwise_xor_(tmp)
    x.mul_(_M1).bitwise_and_(MASK32)
    torch.bitwise_right_shift(x, 15, out=tmp)
    x.bitwise_xor_(tmp)
    x.mul_(_M2).bitwise_and_(MASK32)
    torch.bitwise_right_shift(x, 16, out=tmp)
    x.bitwise_xor_(tmp)


def _bits_into(bits: torch.Tensor, tmp: torch.Tensor, start: int, end: int, key: int) -> None:
    """``bits[:] = hash32((arange(start, end) + key) mod 2**32)`` (int64)."""
    torch.arange(start, end, dtype=torch.int64, device=bits.device, out=bits)
    bits.add_(key).bitwise_and_(MASK32)
    _hash32_(bits, tmp)


def _round_bf16_into(
    out: torch.Tensor, x: torch.Tensor, bits16: torch.Tensor, s: EagerScratch, n: int
) -> None:
    """In-place :func:`optladder.optimizers.rounding.stochastic_round_bf16` into the
    bfloat16 tensor ``out`` (written as bits, so NaN patterns are the kernels')."""
    as_int = x.view(torch.int32)
    rounded, nan_value = s.i32[0][:n], s.i32[1][:n]
    rounded.copy_(bits16)
    rounded.add_(as_int)
    torch.ne(x, x, out=s.mask[:n])  # NaN
    torch.bitwise_or(as_int, 0x00400000, out=nan_value)
    torch.where(s.mask[:n], nan_value, rounded, out=rounded)
    rounded.bitwise_right_shift_(16)
    out.view(torch.int16).copy_(rounded.view(out.shape))  # int32 -> int16: the low 16 bits


def _nearest_bf16_into(out: torch.Tensor, x: torch.Tensor, s: EagerScratch, n: int) -> None:
    """In-place :func:`optladder.optimizers.rounding.nearest_round_bf16` into the bfloat16
    tensor ``out``: round to nearest even, every NaN ``0x7FC0`` (the kernels' bits; torch's
    vectorized ``copy_`` would write ``0xFFFF``)."""
    as_int = x.view(torch.int32)
    rounded, carry = s.i32[0][:n], s.i32[1][:n]
    torch.bitwise_right_shift(as_int, 16, out=carry)
    carry.bitwise_and_(1).add_(0x7FFF)
    torch.add(as_int, carry, out=rounded)  # int32 wraps like the kernels' uint32
    rounded.bitwise_right_shift_(16)  # arithmetic: the low 16 bits are the logical shift's
    torch.ne(x, x, out=s.mask[:n])  # NaN
    rounded.masked_fill_(s.mask[:n], 0x7FC0)
    out.view(torch.int16).copy_(rounded.view(out.shape))  # int32 -> int16: the low 16 bits


def _round_f16_into(
    out: torch.Tensor, x: torch.Tensor, bits: torch.Tensor, s: EagerScratch, n: int
) -> None:
    """In-place :func:`optladder.optimizers.rounding.stochastic_round_f16` into the
    float16 tensor ``out``; ``bits`` (int64, 32 random bits per element) is consumed.
    Uses the int64 buffers 1-3, both int32 buffers, the mask and the float32 buffers 1
    and 4 (grad and denom, free once the param is computed)."""
    a, t, y = (b[:n] for b in s.i64[1:])
    i0, i1 = s.i32[0][:n], s.i32[1][:n]
    f, g, m = s.f32[4][:n], s.f32[1][:n], s.mask[:n]
    i0.copy_(x.view(torch.int32))
    a.copy_(i0).bitwise_and_(0x7FFFFFFF)  # |x| as bits
    # the dropped bits' mask: (1 << clamp(126 - exponent, 13, 23)) - 1
    torch.bitwise_right_shift(a, 23, out=t)
    t.neg_().add_(126).clamp_(13, 23)
    y.fill_(1)
    torch.bitwise_left_shift(y, t, out=t)
    t.sub_(1)
    # |x| >= 2**-24: (a + (bits & mask)) & ~mask
    torch.bitwise_and(bits, t, out=y)
    y.add_(a).bitwise_and_(t.bitwise_not_())
    # |x| < 2**-24: 2**-24 where (bits >> 8) < |x| * 2**48, else 0
    i1.copy_(a)  # < 2**31
    torch.mul(i1.view(torch.float32), 2.0**48, out=f)
    bits.bitwise_right_shift_(8)
    g.copy_(bits)
    torch.lt(g, f, out=m)
    t.copy_(m).mul_(0x33800000)
    torch.ge(a, 103 << 23, out=m)
    torch.where(m, y, t, out=y)
    # the sign (t: 0x80000000 or 0)
    torch.lt(i0, 0, out=m)
    t.copy_(m).mul_(0x80000000)
    y.bitwise_or_(t)
    i1.copy_(y)  # wraps to the int32 pattern
    out.copy_(i1.view(torch.float32).view(out.shape))  # exact: a float16 value
    # NaN -> 0x7E00 with its sign
    torch.gt(a, 0x7F800000, out=m)
    t.bitwise_right_shift_(16).bitwise_or_(0x7E00)
    i1.copy_(t)
    i0.view(out.shape).copy_(out.view(torch.int16))
    torch.where(m, i1, i0, out=i0)
    out.view(torch.int16).copy_(i0.view(out.shape))


def eager_step(
    p: torch.Tensor,
    state: dict[str, Any],
    group: dict[str, Any],
    param_index: int,
    moment_dtype: torch.dtype,
    scratch: EagerScratch,
) -> None:
    """One AdamW step of ``p`` with the oracle's arithmetic, on preallocated scratch.

    Args:
        p: the param (float32, bfloat16, float16 or float64); ``p.grad`` is a dense
            tensor of any floating dtype. A float64 param gets the float32 update added
            in float64 (and decoupled decay applied in float64): it is never rounded to
            float32, so a step with ``lr=0`` leaves it bit for bit.
        state: its state (``step``, ``exp_avg``, ``exp_avg_sq``), already allocated.
        group: its param group (lr, betas, eps, weight_decay, decoupled_weight_decay,
            maximize, rounding, param_rounding, seed).
        param_index: its index over all groups (the random bits' counter).
        moment_dtype: ``torch.bfloat16`` or ``torch.float32``.
        scratch: at least :func:`scratch_length` elements, on ``p``'s device.
    """
    grad_in = p.grad
    assert grad_in is not None
    lr = float(group["lr"])
    beta1, beta2 = group["betas"]
    eps, wd = group["eps"], group["weight_decay"]
    step = int(state["step"].item()) + 1
    step_size, bias_correction2_sqrt = step_scalars(lr, beta1, beta2, step)
    stochastic = moment_dtype == torch.bfloat16 and group["rounding"] == "stochastic"
    round_param = (
        p.dtype in LOW_PRECISION_PARAMS
        and group.get("param_rounding", "stochastic") == "stochastic"
    )
    key = element_key(group["seed"], step, param_index) if stochastic or round_param else 0
    # float64 params: the update is computed in float32 and added to the param in float64
    # (decoupled decay too), so the param itself is never rounded to float32.
    wide = p.dtype == torch.float64
    n_total = p.numel()
    chunked = p.is_contiguous() and grad_in.is_contiguous()
    if chunked:
        views = (p.detach().view(-1), grad_in.detach().view(-1))
        moments = (state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1))
        spans = [(s, min(s + CHUNK, n_total)) for s in range(0, n_total, CHUNK)]
    else:
        views = (p.detach(), grad_in.detach())
        moments = (state["exp_avg"], state["exp_avg_sq"])
        spans = [(0, n_total)]
    for start, end in spans:
        n = end - start
        shape = (n,) if chunked else p.shape

        def cut(t: torch.Tensor, start: int = start, end: int = end) -> torch.Tensor:
            return t[start:end] if chunked else t

        param, grad, exp_avg, exp_avg_sq, denom = (b[:n].view(shape) for b in scratch.f32)
        root = scratch.f64[:n].view(shape)
        grad.copy_(cut(views[1]))
        if group["maximize"]:
            grad.neg_()
        param.copy_(cut(views[0]))
        if wd != 0:
            if not group["decoupled_weight_decay"]:
                grad.add_(param, alpha=wd)
            elif wide:
                cut(views[0]).mul_(1.0 - lr * wd)  # in float64: the param is not rounded
            else:
                param.mul_(1.0 - lr * wd)
        if wide:
            param.zero_()  # below, param holds the float32 update, added in float64
        exp_avg.copy_(cut(moments[0]))
        exp_avg_sq.copy_(cut(moments[1]))
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        root.copy_(exp_avg_sq)
        root.sqrt_()
        denom.copy_(root)  # the IEEE float32 square root (see the module docstring)
        denom.div_(bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=step_size)
        flat = (param.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1))
        bits, tmp = scratch.i64[0][:n], scratch.i64[1][:n]
        if round_param:
            _bits_into(bits, tmp, start, end, param_key(key))
            if p.dtype == torch.bfloat16:
                bits.bitwise_and_(0xFFFF)
                _round_bf16_into(cut(views[0]), flat[0], bits, scratch, n)
            else:
                _round_f16_into(cut(views[0]), flat[0], bits, scratch, n)
        elif wide:
            cut(views[0]).add_(param)
        elif p.dtype == torch.bfloat16:
            _nearest_bf16_into(cut(views[0]), flat[0], scratch, n)
        else:
            cut(views[0]).copy_(param)
        if stochastic:
            _bits_into(bits, tmp, start, end, key)
            torch.bitwise_and(bits, 0xFFFF, out=tmp)
            _round_bf16_into(cut(moments[0]).view(-1), flat[1], tmp, scratch, n)
            torch.bitwise_right_shift(bits, 16, out=tmp)
            _round_bf16_into(cut(moments[1]).view(-1), flat[2], tmp, scratch, n)
        elif moment_dtype == torch.bfloat16:
            _nearest_bf16_into(cut(moments[0]).view(-1), flat[1], scratch, n)
            _nearest_bf16_into(cut(moments[1]).view(-1), flat[2], scratch, n)
        else:
            cut(moments[0]).copy_(exp_avg)
            cut(moments[1]).copy_(exp_avg_sq)
    state["step"].fill_(float(step))
