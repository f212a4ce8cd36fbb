"""Recognizing an out-of-memory error, whatever raised it."""

from __future__ import annotations

import torch

_OOM_TYPES: tuple[type[BaseException], ...] = tuple(
    t
    for t in (
        getattr(torch, "OutOfMemoryError", None),  # torch >= 2.5, every device
        getattr(torch.cuda, "OutOfMemoryError", None),  # torch 2.4
        MemoryError,
    )
    if isinstance(t, type)
)

_OOM_MESSAGES = (
    "can't allocate memory",  # c10 DefaultCPUAllocator
    "cuda out of memory",  # torch's caching allocators
    "hip out of memory",
    "xpu out of memory",
    "mps backend out of memory",
    "error: out of memory",  # "CUDA error: out of memory" from the runtime
    "cublas_status_alloc_failed",  # cuBLAS workspace allocation
    "cudnn_status_alloc_failed",
    "cudaerrormemoryallocation",
    "cuda_error_out_of_memory",
)


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` reports that memory ran out.

    True for ``torch.OutOfMemoryError`` (CUDA and other devices), Python's
    ``MemoryError``, and ``RuntimeError``s whose message is an allocation failure: the CPU
    allocator's "can't allocate memory", a device allocator's "CUDA/HIP/XPU out of
    memory" or "MPS backend out of memory", the CUDA runtime's "error: out of memory", cuBLAS's
    ``CUBLAS_STATUS_ALLOC_FAILED`` and cuDNN's ``CUDNN_STATUS_ALLOC_FAILED``. False for
    everything else.

    Args:
        exc: any exception.
    """
    if isinstance(exc, _OOM_TYPES):
        return True
    if isinstance(exc, RuntimeError):
        message = str(exc).lower()
        return any(m in message for m in _OOM_MESSAGES)
    return False


def describe_error(exc: BaseException) -> str:
    """``"Type: first line of the message"``, at most 300 characters, for logs and reasons."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]
