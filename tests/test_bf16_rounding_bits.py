"""The C kernel's float32 -> bfloat16 roundings, bit for bit, over every special value.

The kernel's ``ol_bf16_sr`` (stochastic) and ``ol_bf16_ne`` (nearest even) are compiled
from the kernel's own source text, with the kernel's flags, into a small harness beside
the masked stochastic form they replaced (95cb684: an integer NaN test
``(u & 0x7FFFFFFF) > 0x7F800000`` instead of the float compare ``x != x``) and compared
with it and with the eager oracle (:func:`optladder.optimizers.rounding.stochastic_round_bf16`;
:func:`~optladder.optimizers.rounding.nearest_round_bf16` for nearest), on:

- every one of the 65,536 high halves (every sign, exponent and bfloat16 mantissa: all
  NaN payload classes, both infinities, the subnormals, both zeros, the largest finite
  values whose rounding carries into infinity) with low halves 0x0000, 0x0001, 0x7FFF,
  0x8000, 0x8001, 0xFFFF and random bits 0, 1, 0x7FFF, 0x8000, 0xFFFF;
- 4,194,304 random float32 patterns with random bits.
"""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest
import torch

from optladder.optimizers.kernels import _cpu_source, cpu
from optladder.optimizers.rounding import nearest_round_bf16, stochastic_round_bf16

pytestmark = pytest.mark.skipif(
    cpu.unavailable_reason() is not None, reason=str(cpu.unavailable_reason())
)

HARNESS = r"""
void ol_test_sr(const float *x, const uint32_t *r, uint16_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = ol_bf16_sr(x[i], r[i]);
}

/* the form before 95cb684 */
static inline uint16_t ol_bf16_sr_masked(float x, uint32_t r16) {
    uint32_t u = ol_f2u(x);
    uint32_t r = u + r16;
    uint32_t n = u | 0x00400000u;
    return (uint16_t)((((u & 0x7FFFFFFFu) > 0x7F800000u) ? n : r) >> 16);
}

void ol_test_sr_masked(const float *x, const uint32_t *r, uint16_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = ol_bf16_sr_masked(x[i], r[i]);
}

void ol_test_ne(const float *x, uint16_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = ol_bf16_ne(x[i]);
}
"""


def _rounding_functions() -> str:
    """The kernel source from its includes through ``ol_bf16_ne`` (the roundings and the
    helpers they use), as shipped."""
    source = _cpu_source.SOURCE
    end = source.index("static inline uint16_t ol_f16_bits")
    assert "ol_bf16_sr" in source[:end] and "ol_bf16_ne" in source[:end]
    return source[:end]


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    folder = tmp_path_factory.mktemp("bf16_rounding")
    src, lib = folder / "harness.c", folder / "harness.so"
    src.write_text(_rounding_functions() + HARNESS)
    cc = cpu.compiler()
    assert cc is not None
    done = subprocess.run(
        [cc, *cpu._CFLAGS, str(src), "-o", str(lib), "-lm"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return ctypes.CDLL(str(Path(lib)))


def _run(fn: ctypes._CFuncPtr, *tensors: torch.Tensor) -> torch.Tensor:
    out = torch.empty(tensors[0].numel(), dtype=torch.int16)
    pointers = [ctypes.c_void_p(t.data_ptr()) for t in (*tensors, out)]
    fn(*pointers, ctypes.c_int64(out.numel()))
    return out


def _cases() -> tuple[torch.Tensor, torch.Tensor]:
    """float32 values (as a float32 tensor) and their 16 random bits (int32 in [0, 2**16))."""
    high = torch.arange(1 << 16, dtype=torch.int64) << 16
    lows = torch.tensor([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF])
    bits = torch.tensor([0x0000, 0x0001, 0x7FFF, 0x8000, 0xFFFF])
    u = (high[:, None, None] | lows[None, :, None]).expand(-1, -1, len(bits)).reshape(-1)
    r = bits[None, None, :].expand(len(high), len(lows), -1).reshape(-1)
    gen = torch.Generator().manual_seed(95)
    n = 1 << 22
    u = torch.cat([u, torch.randint(0, 1 << 32, (n,), generator=gen)])
    r = torch.cat([r, torch.randint(0, 1 << 16, (n,), generator=gen)])
    x = (u - ((u >> 31) << 32)).to(torch.int32).view(torch.float32)  # the patterns, as float32
    return x, r.to(torch.int32)


def test_the_special_values_are_covered() -> None:
    x, r = _cases()
    u = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    a = u & 0x7FFFFFFF
    assert int((a > 0x7F800000).sum()) > 2 * 127 * 30  # every NaN payload class, both signs
    assert {0x7F800000, 0xFF800000} <= set(u[a == 0x7F800000].tolist())
    assert int(((a > 0) & (a < 0x00800000)).sum()) > 2 * 127 * 30  # subnormals
    # finite values that the stochastic rounding carries into infinity
    assert bool(((a >= 0x7F7F0000) & (a < 0x7F800000) & (((a & 0xFFFF) + r) >= 0x10000)).any())


def test_float_compare_nan_test_writes_the_masked_forms_bits(harness: ctypes.CDLL) -> None:
    x, r = _cases()
    r32 = r.contiguous()
    new = _run(harness.ol_test_sr, x, r32)
    old = _run(harness.ol_test_sr_masked, x, r32)
    assert torch.equal(new, old)
    eager = stochastic_round_bf16(x, r).view(torch.int16)
    assert torch.equal(new, eager)
    # what the NaN handling is for: NaN stays NaN (quiet), never turning into an infinity or
    # into a number through a carry into the sign; +-inf stay themselves
    y = new.view(torch.bfloat16).float()
    nan = torch.isnan(x)
    assert bool(torch.isnan(y[nan]).all()) and bool((new[nan] & 0x0040).ne(0).all())
    assert bool(((new[nan] < 0) == (x[nan].view(torch.int32) < 0)).all())  # sign kept
    inf = torch.isinf(x)
    assert torch.equal(y[inf], x[inf])


def test_nearest_even_matches_the_oracle_and_torch_on_numbers(harness: ctypes.CDLL) -> None:
    """Nearest even: the oracle's bits everywhere; torch's conversion's on every non-NaN
    value (its vectorized CPU path writes NaN as 0xFFFF, the kernels as 0x7FC0)."""
    x, _ = _cases()
    got = _run(harness.ol_test_ne, x)
    assert torch.equal(got, nearest_round_bf16(x).view(torch.int16))
    nan = torch.isnan(x)
    assert bool((got[nan] == 0x7FC0).all())
    assert torch.equal(got[~nan], x[~nan].to(torch.bfloat16).view(torch.int16))
