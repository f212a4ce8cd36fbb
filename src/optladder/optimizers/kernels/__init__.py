"""Fused backends of optladder's AdamW (the bf16 rung, and the fp32 rung for bf16/fp16
params): a C kernel for CPUs and a Triton kernel for CUDA.

Importing this package imports neither Triton nor a compiler: :mod:`.cpu` builds its
shared object at the first fused CPU step, and :mod:`.ops` / :mod:`.triton_adamw` are
imported at the first Triton step. The functions here only say whether a backend can run.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from optladder.optimizers.kernels.cpu import unavailable_reason as cpu_unavailable_reason

__all__ = [
    "cpu_unavailable_reason",
    "triton_dtype_unsupported_reason",
    "triton_param_unsupported_reason",
    "triton_unavailable_reason",
]


@functools.cache
def triton_unavailable_reason() -> str | None:
    """Why the Triton kernel cannot run in this environment, or None if it can.

    Cheap: it looks for the package without importing it, once per process.
    """
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton, the version torch pins)"
    return None


def triton_param_unsupported_reason(
    p: torch.Tensor, grad: torch.Tensor, moment_dtype: torch.dtype
) -> str | None:
    """Why the Triton kernel cannot step this param, or None if it can.

    Args:
        p: the param (float32, bfloat16 or float16, contiguous; CUDA, or CPU under
            ``TRITON_INTERPRET=1``).
        grad: its grad (float32, bfloat16 or float16, dense, contiguous, same device/shape).
        moment_dtype: the moments' dtype (bfloat16 or float32).
    """
    if p.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton runs CPU tensors only in its interpreter (TRITON_INTERPRET=1)"
    if p.device.type not in ("cpu", "cuda"):
        return f"param is on {p.device}; the Triton kernel runs on CUDA"
    why = triton_dtype_unsupported_reason(p.dtype, grad.dtype, moment_dtype)
    if why is not None:
        return why
    if grad.is_sparse or grad.device != p.device or grad.shape != p.shape:
        return "grad is sparse, on another device or of another shape"
    if not (p.is_contiguous() and grad.is_contiguous()):
        return "param or grad is not contiguous"
    return None


def triton_dtype_unsupported_reason(
    param_dtype: torch.dtype, grad_dtype: torch.dtype, moment_dtype: torch.dtype
) -> str | None:
    """Why the Triton kernel cannot step a param of ``param_dtype`` with a grad of
    ``grad_dtype`` and moments of ``moment_dtype``, or None if it can."""
    if param_dtype not in _KERNEL_DTYPES:
        return (
            f"param dtype {param_dtype}: the Triton kernel steps float32, bfloat16, float16 params"
        )
    if grad_dtype not in _KERNEL_DTYPES:
        return f"grad dtype {grad_dtype}: the Triton kernel reads float32, bfloat16, float16"
    if moment_dtype not in (torch.float32, torch.bfloat16):
        return f"moment dtype {moment_dtype}: the Triton kernel keeps float32 or bfloat16"
    return None


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
