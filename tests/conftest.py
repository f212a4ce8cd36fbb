"""Shared fixtures: a clean environment for the override variables; the C kernel's SIMD
paths."""

from __future__ import annotations

import functools

import pytest

_VARS = ("OPTLADDER_BF16_ADAM", "OPTLADDER_8BIT_ADAM", "OPTLADDER_RUNG")


@pytest.fixture(autouse=True)
def _no_override_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests start without optladder variables, whatever the caller's shell has set."""
    for name in _VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(params=[0, 1, 2], ids=["c-loop", "avx2", "avx512"])
def kernel_simd(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Each path of the bf16/fp32 C kernel in turn (``cpu.run_table``'s ``simd`` cap:
    gcc's vectorized C loop, the AVX2 intrinsics, the AVX-512 intrinsics), skipping those
    this CPU cannot run: every path must write the eager oracle's bits."""
    from optladder.optimizers.kernels import cpu

    level = int(request.param)
    if level > cpu.simd_level():
        pytest.skip(f"this CPU runs the C kernel's SIMD paths up to level {cpu.simd_level()}")
    monkeypatch.setattr(cpu, "run_table", functools.partial(cpu.run_table, simd=level))
    return level
