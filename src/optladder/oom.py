"""Recognizing an out-of-memory error, whatever raised it."""

from __future__ import annotations

import re

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


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50}
_CUDA_ASK = re.compile(r"tried to allocate (\d+(?:\.\d+)?) ?(B|KiB|MiB|GiB|TiB|PiB)\b", re.I)
_CPU_ASK = re.compile(r"you tried to allocate (\d+) bytes", re.I)


def requested_bytes(exc: BaseException) -> int | None:
    """The size of the allocation that failed, in bytes, from torch's OOM message; None
    when the message does not say.

    Reads torch's CUDA caching allocator ("CUDA out of memory. Tried to allocate 20.00
    MiB", rounded to two decimals as torch prints it) and the CPU allocator
    ("DefaultCPUAllocator: can't allocate memory: you tried to allocate 20971520 bytes").

    Args:
        exc: an out-of-memory error (see :func:`is_oom`).
    """
    message = str(exc)
    cpu = _CPU_ASK.search(message)
    if cpu is not None:
        return int(cpu.group(1))
    cuda = _CUDA_ASK.search(message)
    if cuda is not None:
        unit = next(u for u in _UNITS if u.lower() == cuda.group(2).lower())
        return int(float(cuda.group(1)) * _UNITS[unit])
    return None
