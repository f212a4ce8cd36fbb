"""The 8-bit rung: bitsandbytes' ``AdamW8bit`` (block-wise quantized moments).

Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (ICLR 2022). bitsandbytes
is imported only when this rung is built.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType
from typing import Any

import torch

from optladder.rungs import BNB_MIN_8BIT_SIZE

_BNB_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NOISY_LOGGER = "bitsandbytes.backends.cpu.ops"


def import_bitsandbytes() -> ModuleType:
    """Import bitsandbytes, hushing its CPU backend's warning about an optional 4-bit
    GEMM kernel from a hub (irrelevant to optimizers, and unreachable offline).

    Raises:
        ImportError: if bitsandbytes is missing or its native library fails to load.
    """
    noisy = logging.getLogger(_NOISY_LOGGER)
    previous = noisy.level
    noisy.setLevel(logging.ERROR)
    try:
        return importlib.import_module("bitsandbytes")
    except ImportError:
        raise
    except Exception as exc:  # a broken native library raises other errors
        raise ImportError(f"bitsandbytes failed to import: {type(exc).__name__}: {exc}") from exc
    finally:
        noisy.setLevel(previous)


def build_8bit(
    param_groups: list[dict[str, Any]],
    *,
    lr: float | torch.Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> torch.optim.Optimizer:
    """Build ``bitsandbytes.optim.AdamW8bit`` over ``param_groups``.

    Tensors under bitsandbytes' ``min_8bit_size`` (4096 elements) keep float32 moments;
    larger ones keep uint8 codes with one float32 absmax per 256-element block.

    Raises:
        ImportError: if bitsandbytes does not import (install ``optladder[8bit]``).
        ValueError: for complex params or dtypes bitsandbytes does not take.
    """
    for gi, group in enumerate(param_groups):
        for pi, p in enumerate(group["params"]):
            if p.is_complex():
                raise ValueError(
                    f"param {pi} of group {gi} is complex ({p.dtype}); the 8bit rung takes real "
                    "params only: use rung='fp32'"
                )
            if p.dtype not in _BNB_DTYPES:
                raise ValueError(
                    f"param {pi} of group {gi} has dtype {p.dtype}; the 8bit rung takes "
                    "float32, bfloat16 or float16 params"
                )
    try:
        bnb = import_bitsandbytes()
    except ImportError as exc:
        raise ImportError(
            f"the 8bit rung needs bitsandbytes, which does not import ({exc}); "
            "pip install 'optladder[8bit]'"
        ) from exc
    return bnb.optim.AdamW8bit(
        param_groups,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        min_8bit_size=BNB_MIN_8BIT_SIZE,
    )
