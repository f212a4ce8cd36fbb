"""The fused-spec mapping: the one place that says which configuration runs on a fused
kernel, which falls back to an eager or foreach path, and why.

Each ``*_fused_miss`` function returns None when the configuration is fused, or the
reason in a sentence when it is not.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch

LOW_PRECISION_DTYPES = ("bfloat16", "float16")

Fp32Engine = Literal["fused", "foreach", "eager"]
"""How the fp32 rung runs: torch's fused AdamW, torch's foreach AdamW, or optladder's
eager AdamW with float32 moments (for bf16/fp16 params)."""


def torch_fused_device_types() -> tuple[str, ...]:
    """Device types for which the installed torch has fused Adam/AdamW kernels."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return tuple(_get_fused_kernels_supported_devices())
    except ImportError:  # pragma: no cover - older or trimmed torch
        return ("cuda",)


def fp32_fused_miss(
    device_fused: bool,
    device: str,
    dtypes: Iterable[str],
    has_complex: bool,
    *,
    maximize: bool = False,
    amsgrad: bool = False,
) -> str | None:
    """Why the fp32 rung is not on torch's fused AdamW, or None when it is.

    Args:
        device_fused: whether a fused AdamW step ran (or is listed) for the device.
        device: the device, for the message.
        dtypes: names of the trainable params' dtypes, e.g. ``("float32",)``.
        has_complex: whether any trainable param is complex.
        maximize, amsgrad: torch options (both are fused in torch; listed for the
            record, they never cause a miss).
    """
    del maximize, amsgrad
    if not device_fused:
        return f"torch {torch.__version__} has no fused AdamW kernel on {device}; foreach path"
    low = sorted(set(dtypes) & set(LOW_PRECISION_DTYPES))
    if low:
        return (
            f"torch's fused AdamW keeps moments in the param dtype ({', '.join(low)}); the fp32 "
            "rung keeps float32 moments for them on optladder's eager AdamW"
        )
    if has_complex:
        return "torch's fused AdamW takes real params only; complex params use the foreach path"
    return None


def fp32_engine(fused: bool, dtypes: Iterable[str]) -> Fp32Engine:
    """Which engine the fp32 rung builds.

    Args:
        fused: whether the decision found the fp32 rung fused (see
            :func:`fp32_fused_miss`).
        dtypes: names of the trainable params' dtypes.
    """
    if set(dtypes) & set(LOW_PRECISION_DTYPES):
        return "eager"  # torch would keep their moments in bf16/fp16
    return "fused" if fused else "foreach"


def bf16_fused_miss(device_type: str, dtypes: Iterable[str] = ("float32",)) -> str | None:
    """Why the bf16 rung is not on a fused kernel on ``device_type``, or None.

    The fused kernels (:mod:`optladder.optimizers.kernels`: C on the CPU, Triton on CUDA)
    step float32 params; other params, and devices without a kernel, run the eager path
    (:mod:`optladder.optimizers.eager`), bit-identical but several times slower.

    Args:
        device_type: ``"cpu"``, ``"cuda"``, ...
        dtypes: names of the trainable params' dtypes.
    """
    from optladder.optimizers import kernels

    other = sorted(set(dtypes) - {"float32"})
    if other:
        return (
            f"the bf16 kernels step float32 params; {', '.join(other)} params run the eager "
            "path"
        )
    if device_type == "cpu":
        why = kernels.cpu_unavailable_reason()
    elif device_type == "cuda":
        why = kernels.triton_unavailable_reason()
    else:
        why = f"no fused bf16 kernel for {device_type}"
    return None if why is None else f"{why}; the bf16 rung runs the eager path"


def eightbit_fused_miss(device_type: str) -> str | None:
    """Why the 8-bit rung is not on a fused kernel on ``device_type``, or None.

    bitsandbytes runs one block-wise 8-bit kernel per tensor on CUDA; elsewhere it runs a
    per-tensor fallback, tens of times slower than torch's fused fp32 AdamW on the CPU.
    """
    if device_type == "cuda":
        return None
    return f"bitsandbytes has no fused 8-bit optimizer kernel on {device_type}"
