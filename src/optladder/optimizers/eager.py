"""The eager AdamW step of :class:`LadderAdamW`, allocating nothing while it writes.

:meth:`LadderAdamW._step_param` is the oracle: readable, and it allocates its float32
copies as it goes. This module performs the same operations, in the same order and with
the same kernels (``lerp_``, ``mul_``/``addcmul_``, ``sqrt``, ``addcdiv_``, the same integer
hash and rounding), on scratch buffers allocated beforehand (:class:`EagerScratch`), so
the commit phase of a two-phase step cannot run out of memory. Contiguous params are
processed in chunks of at most :data:`CHUNK` elements, which bounds the scratch; every
operation is elementwise and the random bits are indexed by the global element index, so
chunking changes no bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from optladder.optimizers.rounding import _M1, _M2, MASK32, element_key

CHUNK = 1 << 18
"""Elements per chunk of a contiguous param (262,144: 45 bytes each of scratch, 11.8 MB)."""


@dataclass
class EagerScratch:
    """Preallocated buffers for :func:`eager_step`, each of ``length`` elements.

    float32: param, grad, exp_avg, exp_avg_sq, denom; int64: bits, tmp; int32: rounded,
    nan_value; bool: is_nan. 45 bytes per element.
    """

    length: int
    device: torch.device
    f32: tuple[torch.Tensor, ...]
    i64: tuple[torch.Tensor, torch.Tensor]
    i32: tuple[torch.Tensor, torch.Tensor]
    mask: torch.Tensor

    @classmethod
    def allocate(cls, length: int, device: torch.device) -> EagerScratch:
        """Allocate the buffers (this is where an OOM can happen)."""
        return cls(
            length,
            device,
            tuple(torch.empty(length, dtype=torch.float32, device=device) for _ in range(5)),
            (
                torch.empty(length, dtype=torch.int64, device=device),
                torch.empty(length, dtype=torch.int64, device=device),
            ),
            (
                torch.empty(length, dtype=torch.int32, device=device),
                torch.empty(length, dtype=torch.int32, device=device),
            ),
            torch.empty(length, dtype=torch.bool, device=device),
        )


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


def _round_into(
    out: torch.Tensor, x: torch.Tensor, bits16: torch.Tensor, s: EagerScratch, n: int
) -> None:
    """In-place :func:`optladder.optimizers.rounding.stochastic_round_bf16` into ``out``."""
    as_int = x.view(torch.int32)
    rounded, nan_value = s.i32[0][:n], s.i32[1][:n]
    rounded.copy_(bits16)
    rounded.add_(as_int).bitwise_and_(-65536)
    torch.ne(x, x, out=s.mask[:n])  # NaN
    torch.bitwise_and(as_int, -65536, out=nan_value)
    nan_value.bitwise_or_(0x00400000)
    torch.where(s.mask[:n], nan_value, rounded, out=rounded)
    out.copy_(rounded.view(torch.float32))


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
        p: the param; ``p.grad`` is a dense tensor.
        state: its state (``step``, ``exp_avg``, ``exp_avg_sq``), already allocated.
        group: its param group (lr, betas, eps, weight_decay, decoupled_weight_decay,
            maximize, rounding, seed).
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
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    stochastic = moment_dtype == torch.bfloat16 and group["rounding"] == "stochastic"
    key = element_key(group["seed"], step, param_index) if stochastic else 0
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
        grad.copy_(cut(views[1]))
        if group["maximize"]:
            grad.neg_()
        param.copy_(cut(views[0]))
        if wd != 0:
            if group["decoupled_weight_decay"]:
                param.mul_(1.0 - lr * wd)
            else:
                grad.add_(param, alpha=wd)
        exp_avg.copy_(cut(moments[0]))
        exp_avg_sq.copy_(cut(moments[1]))
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        torch.sqrt(exp_avg_sq, out=denom)
        denom.div_(bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
        cut(views[0]).copy_(param)
        if stochastic:
            bits, tmp = scratch.i64[0][:n], scratch.i64[1][:n]
            torch.arange(start, end, dtype=torch.int64, device=p.device, out=bits)
            bits.add_(key).bitwise_and_(MASK32)
            _hash32_(bits, tmp)
            torch.bitwise_and(bits, 0xFFFF, out=tmp)
            _round_into(cut(moments[0]).view(-1), exp_avg.view(-1), tmp, scratch, n)
            torch.bitwise_right_shift(bits, 16, out=tmp)
            _round_into(cut(moments[1]).view(-1), exp_avg_sq.view(-1), tmp, scratch, n)
        else:
            cut(moments[0]).copy_(exp_avg)
            cut(moments[1]).copy_(exp_avg_sq)
    state["step"].fill_(float(step))
