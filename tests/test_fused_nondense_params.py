"""Params that are not dense (a column slice of a buffer: views of one buffer that do not
overlap, which construction accepts) on the fp32 rung, whose commit is torch's fused
kernel: torch 2.13's ``AdamW(fused=True)`` steps such a param's memory as ``numel``
consecutive elements, so it updates the wrong elements and writes over the buffer's
other columns. optladder must step them as torch steps a contiguous copy (the
reference here) and leave the rest of the buffer alone, on the direct kernel call and on
torch's functional fused AdamW alike (a tensor lr)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from optladder import choose_optimizer
from snapshots import assert_steps_as_torch


def _setup() -> tuple[torch.Tensor, torch.Tensor, list[Any], list[Any]]:
    gen = torch.Generator().manual_seed(0)
    buf = torch.randn(12, 9, generator=gen)
    original = buf.clone()
    cols = buf[:, 2:6].requires_grad_()  # stride (9, 1): not dense
    other = torch.nn.Parameter(torch.randn(5, 4, generator=gen))
    ref = [torch.nn.Parameter(cols.detach().clone()), torch.nn.Parameter(other.detach().clone())]
    return buf, original, [cols, other], ref


def _backward(ours: list[Any], ref: list[Any], seed: int) -> None:
    """Autograd's grads: contiguous for the column slice (its layout is not dense)."""
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(p.shape, generator=gen) for p in ours]
    for ps in (ours, ref):
        sum(((p * w) ** 2).sum() for p, w in zip(ps, weights)).backward()


def _outside_untouched(buf: torch.Tensor, original: torch.Tensor) -> bool:
    return torch.equal(buf[:, :2], original[:, :2]) and torch.equal(buf[:, 6:], original[:, 6:])


def test_a_column_slice_steps_as_torch_steps_a_contiguous_copy() -> None:
    buf, original, ours, ref = _setup()
    opt = choose_optimizer(ours, lr=1e-2, weight_decay=0.1, free_memory="1GiB", environ={})
    assert opt.rung == "fp32"
    reference = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
    for s in range(4):
        if s == 2:  # grads kept and accumulated into
            opt.zero_grad(set_to_none=False)
            reference.zero_grad(set_to_none=False)
        else:
            opt.zero_grad()
            reference.zero_grad()
        _backward(ours, ref, s)
        opt.step()
        reference.step()
        assert_steps_as_torch(opt, ours, reference, ref)
        assert _outside_untouched(buf, original), f"step {s} wrote outside the param"


def _column_slice_grads(ours: list[Any], ref: list[Any], seed: int, scale: float) -> None:
    """Grads of step ``seed``: the column slice's laid out like it (a slice of a wider
    buffer, times ``scale``), the other param's contiguous (times ``scale``); the
    reference params get the unscaled values, contiguous."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(12, 4, generator=gen)
    grad_buf = torch.zeros(12, 9)
    grad_buf[:, 2:6] = g * scale  # the param's strides
    ours[0].grad, ref[0].grad = grad_buf[:, 2:6], g.clone()
    other = torch.randn(5, 4, generator=gen)
    ours[1].grad, ref[1].grad = other * scale, other.clone()


def test_a_grad_laid_out_like_the_column_slice_steps_as_torch() -> None:
    buf, original, ours, ref = _setup()
    opt = choose_optimizer(ours, lr=1e-2, free_memory="1GiB", environ={})
    reference = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    for s in range(3):
        _column_slice_grads(ours, ref, s, 1.0)
        opt.step()
        reference.step()
        assert_steps_as_torch(opt, ours, reference, ref)
        assert _outside_untouched(buf, original)


def test_a_tensor_lr_steps_a_column_slice_as_torch_steps_a_contiguous_copy() -> None:
    """A tensor lr takes torch's functional fused AdamW (which moves it per device): the
    column slice goes through its contiguous copy there too (it was refused when the
    engine was torch's AdamW, whose own ``step`` would write over the buffer)."""
    buf, original, ours, ref = _setup()
    opt = choose_optimizer(ours, lr=1e-2, free_memory="1GiB", environ={})
    reference = torch.optim.AdamW(ref, lr=torch.tensor(1e-2), fused=True)
    for group in opt.param_groups:
        group["lr"] = torch.tensor(1e-2)
    for s in range(3):
        opt.zero_grad()
        reference.zero_grad()
        _backward(ours, ref, s)
        opt.step()
        reference.step()
        assert_steps_as_torch(opt, ours, reference, ref)
        assert _outside_untouched(buf, original), f"step {s} wrote outside the param"


def test_a_numpy_lr_steps_a_column_slice_as_torch() -> None:
    """A scheduler computing with numpy sets a ``numpy.float64`` lr (a float subclass):
    the direct kernel call takes it as torch's ``step`` would, so the column slice is
    stepped (not refused as a tensor lr is)."""
    np = pytest.importorskip("numpy")
    buf, original, ours, ref = _setup()
    opt = choose_optimizer(ours, lr=1e-2, free_memory="1GiB", environ={})
    reference = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    for s in range(3):
        for group in (*opt.param_groups, *reference.param_groups):
            group["lr"] = np.float64(1e-2) * np.cos(s / 10)
        opt.zero_grad()
        reference.zero_grad()
        _backward(ours, ref, s)
        opt.step()
        reference.step()
        assert_steps_as_torch(opt, ours, reference, ref)
        assert _outside_untouched(buf, original)


def test_scaled_grads_laid_out_like_a_column_slice_are_unscaled_before_the_kernel() -> None:
    """Under grad scaling the grads are unscaled in place after prepare (the commit).
    A grad copied in prepare would keep the scaled values: the copies are filled in the
    commit, after the unscaling."""
    buf, original, ours, ref = _setup()
    opt = choose_optimizer(ours, lr=1e-2, free_memory="1GiB", environ={})
    reference = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    for s in range(3):
        _column_slice_grads(ours, ref, s, 4.0)  # scaled by 4 (exact)
        opt.grad_scale = torch.tensor(4.0)  # as torch.amp.GradScaler sets it
        opt.found_inf = torch.tensor(0.0)
        opt.step()
        reference.step()
        assert_steps_as_torch(opt, ours, reference, ref)
        assert _outside_untouched(buf, original)
