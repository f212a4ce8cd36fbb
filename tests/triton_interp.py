"""Run the Triton kernels in Triton's interpreter with an exactly rounded ``tl.fma``.

Triton's interpreter evaluates ``tl.fma(x, y, z)`` as ``x * y + z`` in float32 numpy,
two roundings; the compiled kernel (``fma.rn.f32`` on CUDA) and torch's vectorized CPU
kernels (``fmadd``) round once. :func:`exact_fma_interpreter` patches the interpreter's
``create_fma`` with a once-rounded float32 fma: the product of two float32 values is
exact in float64, the float64 sum is rounded *to odd* (TwoSum gives its exact error;
an inexact sum with an even last bit steps one ulp toward the error), and a float64
rounded to odd rounds correctly to float32 (53 >= 24 + 2 bits; Boldo & Melquiond,
"Emulation of FMA and correctly rounded sums: proved algorithms using rounding to
odd", IEEE TC 2008). Then the interpreted kernel is bitwise comparable with the eager
oracle.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import numpy as np


def exact_fma(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """float32 ``x * y + z`` rounded once (round to nearest even), elementwise."""
    x64, y64, z64 = np.broadcast_arrays(*(np.asarray(a, dtype=np.float64) for a in (x, y, z)))
    prod = x64 * y64  # exact: 24 + 24 bits
    s = np.asarray(prod + z64)
    bb = s - prod
    err = (prod - (s - bb)) + (z64 - bb)  # TwoSum: s + err == prod + z exactly
    even = (s.view(np.int64) & 1) == 0
    adjust = (err != 0) & even & np.isfinite(s)
    toward = np.where(err > 0, np.inf, -np.inf)
    s = np.where(adjust, np.nextafter(s, toward), s)
    return s.astype(np.float32)


@contextlib.contextmanager
def exact_fma_interpreter() -> Iterator[None]:
    """Set ``TRITON_INTERPRET=1`` and patch the interpreter's fma, for the duration."""
    from triton.runtime import interpreter

    old_env = os.environ.get("TRITON_INTERPRET")
    old_fma = interpreter.InterpreterBuilder.create_fma

    def create_fma(self, x, y, z):  # type: ignore[no-untyped-def]
        if z.dtype.scalar.primitive_bitwidth != 32:
            return old_fma(self, x, y, z)
        return interpreter.TensorHandle(exact_fma(x.data, y.data, z.data), z.dtype.scalar)

    os.environ["TRITON_INTERPRET"] = "1"
    interpreter.InterpreterBuilder.create_fma = create_fma  # type: ignore[method-assign]
    try:
        yield
    finally:
        interpreter.InterpreterBuilder.create_fma = old_fma  # type: ignore[method-assign]
        if old_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old_env
