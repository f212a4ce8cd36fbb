"""The CPU kernel's NaN handling per block of 16 elements (its AVX2 loop checks the new
params of a block once and takes the per-value NaN test only in blocks with a NaN
param): NaN and infinite grads, params and moments placed in later blocks, in either
8-lane half, and in the scalar tail, write the eager oracle's bits, NaN payloads whose
low bits would carry included."""

from __future__ import annotations

from typing import Literal

import pytest
import torch

from optladder.optimizers.adamw import LadderAdamW
from optladder.optimizers.kernels import cpu

needs_gcc = pytest.mark.skipif(
    cpu.unavailable_reason() is not None, reason=str(cpu.unavailable_reason())
)


def _f32(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32).item()


# NaNs whose low payload bits are all ones (quiet and signalling, both signs): without
# the NaN test, adding the random bits would carry them into an infinity or the sign
NAN, SNAN, NEG_NAN, INF = _f32(0x7FFFFFFF), _f32(0x7FBFFFFF), _f32(0xFFFFFFFF), float("inf")
# (tensor, index, value): blocks 1-4 of 16, both halves of a block, and the 13-element tail
SPOTS = (
    ("m", 17, NAN), ("v", 30, SNAN), ("v", 33, INF), ("p", 47, NEG_NAN), ("p", 52, -INF),
    ("g", 63, NAN), ("g", 66, INF), ("m", 70, -INF), ("g", 72, SNAN), ("p", 76, INF),
)  # fmt: skip


def _step(
    backend: Literal["cpu", "eager"],
    moment_dtype: torch.dtype,
    param_dtype: torch.dtype,
    rounding: Literal["stochastic", "nearest"],
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    n = 77
    x = {
        "p": torch.randn(n, generator=gen),
        "g": torch.randn(n, generator=gen) * 0.1,
        "m": torch.randn(n, generator=gen) * 0.01,
        "v": torch.rand(n, generator=gen) * 1e-3,
    }
    for name, i, value in SPOTS:
        x[name][i] = value
    p = torch.nn.Parameter(x["p"].to(param_dtype))
    opt = LadderAdamW(
        [p], backend=backend, moment_dtype=moment_dtype, seed=3, weight_decay=0.01,
        rounding=rounding, param_rounding=rounding,
    )  # fmt: skip
    opt.state[p] = {
        "step": torch.tensor(2.0, dtype=torch.float64),
        "exp_avg": x["m"].to(moment_dtype),
        "exp_avg_sq": x["v"].to(moment_dtype),
    }
    p.grad_dtype = None  # float32 grads (their NaN payloads) on bfloat16 params too
    p.grad = x["g"]
    opt.step()
    assert backend == "eager" or opt.eager_reasons == {}, opt.eager_reasons
    st = opt.state[p]
    return [t.detach().reshape(-1).view(torch.int32 if t.element_size() == 4 else torch.int16)
            for t in (p, st["exp_avg"], st["exp_avg_sq"])]  # fmt: skip


@needs_gcc
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("moment_dtype", [torch.bfloat16, torch.float32])
def test_nan_and_inf_in_later_blocks_write_the_eager_bits(
    moment_dtype: torch.dtype, param_dtype: torch.dtype, rounding: Literal["stochastic", "nearest"]
) -> None:
    got = _step("cpu", moment_dtype, param_dtype, rounding)
    ref = _step("eager", moment_dtype, param_dtype, rounding)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), ref, got, strict=True):
        assert torch.equal(a, b), name
    # the spots are NaN/inf where they should be: a NaN grad makes every output NaN
    p = got[0]
    nan_p = p.view(torch.float32 if p.element_size() == 4 else torch.bfloat16).isnan()
    assert bool(nan_p[[17, 30, 47, 63, 72]].all())
    assert int(nan_p.sum()) < 20  # the other blocks' elements stay numbers
